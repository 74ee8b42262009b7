from __future__ import annotations

from polar_env.demo import run_demo


async def test_demo_episode_end_to_end(tmp_path, capsys) -> None:
    """README command 1: engine + gateway + a streamed Anthropic tool loop + merged trajectory."""
    assert await run_demo(store_dir=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "The command printed: hi" in out and "demo ok" in out
    assert (tmp_path / "demo.jsonl").exists()
