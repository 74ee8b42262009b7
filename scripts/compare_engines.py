"""Send the same chat requests to real vLLM and to our embedded engine, and check they agree.

Why: ``polar_env``'s embedded engine stands in for vLLM in tests and demos, so everything a
trainer or gateway reads from vLLM must come back the same from it: the JSON shape, the prompt
ids our Python Qwen3.5 template + tokenizer produce, token-in, greedy ids and logprobs (same
weights, fp32, ``--logprobs-mode processed_logprobs``), ``logit_bias``, tool-call parsing, error
bodies, and tokens that have no clean text (padded vocabulary rows, lone UTF-8 bytes).
``scripts/check_vllm_cpu.sh`` starts both servers on 127.0.0.1 and runs this; it can also be
pointed at servers started by hand (127.0.0.1 only)::

    python scripts/compare_engines.py --vllm http://127.0.0.1:8001 --ours http://127.0.0.1:8002

Verdicts: PASS; FAIL (a contract break, exit status 1); NOTE (a difference worth knowing that
does not break a client written against vLLM, e.g. a key only one side sends while both agree on
every key clients read). Policy for key sets (check a):

- a key vLLM sends that we lack -> FAIL when it carries information (not always null in vLLM's
  reply), NOTE when vLLM itself sends only null there;
- a key only we send -> NOTE (OpenAI-style clients ignore unknown keys);
- both sides send a key with different non-null JSON types -> FAIL; null on one side only -> FAIL
  unless the key is in ``NULLABLE_OK`` (values that legitimately depend on the server build).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp

from polar_env.qwen.parser import parse_output
from polar_env.qwen.tokenizer import ENDOFTEXT_ID, IM_END_ID, load_tokenizer

MODEL = "polar-tiny-qwen3"
EOS_IDS = {IM_END_ID, ENDOFTEXT_ID}
# vLLM's first request warms the CPU kernels (about 40 s on 2 cores); give every call ample room.
REQUEST_TIMEOUT_S = 600
# Keys whose null-ness may differ without breaking a client (the value is server metadata).
NULLABLE_OK = {"system_fingerprint", "param"}  # error.param: vLLM names it only for some errors

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
# A tool call exactly as our template renders one (and as Qwen3.5 writes one).
TOOL_CALL_TEXT = "<tool_call>\n<function=bash>\n<parameter=command>\necho hi\n</parameter>\n</function>\n</tool_call>"

Verdict = Literal["PASS", "FAIL", "NOTE"]


@dataclass
class Row:
    check: str
    verdict: Verdict
    summary: str
    details: list[str] = field(default_factory=list)


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON, or the raw text when the body is not JSON
    seconds: float = 0.0


@dataclass
class Exchange:
    """One request sent to both servers, kept for --json-out and for FAIL details."""

    label: str
    request: Any
    vllm: Reply
    ours: Reply


class Comparer:
    def __init__(
        self, session: aiohttp.ClientSession, vllm_url: str, ours_url: str, logprob_tol: float, strict_ids: bool
    ) -> None:
        self.session = session
        self.strict_ids = strict_ids
        self.urls = {"vllm": vllm_url.rstrip("/"), "ours": ours_url.rstrip("/")}
        self.logprob_tol = logprob_tol
        self.tokenizer = load_tokenizer()
        self.rows: list[Row] = []
        self.exchanges: list[Exchange] = []

    # -- transport ----------------------------------------------------------------------------
    async def _post(self, side: str, body: Any, raw: bytes | None = None) -> Reply:
        data = raw if raw is not None else json.dumps(body).encode()
        started = time.perf_counter()
        async with self.session.post(
            self.urls[side] + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            text = await resp.text()
        elapsed = time.perf_counter() - started
        try:
            return Reply(resp.status, json.loads(text), elapsed)
        except json.JSONDecodeError:
            return Reply(resp.status, text, elapsed)

    async def both(self, label: str, body: Any, raw: bytes | None = None) -> Exchange:
        # vLLM first, then ours: sequential keeps the 2-core box from timing both at once.
        vllm = await self._post("vllm", body, raw)
        ours = await self._post("ours", body, raw)
        ex = Exchange(label, raw.decode() if raw is not None else body, vllm, ours)
        self.exchanges.append(ex)
        return ex

    def add(self, check: str, verdict: Verdict, summary: str, details: Sequence[str] = ()) -> None:
        self.rows.append(Row(check, verdict, summary, list(details)))

    # -- helpers ------------------------------------------------------------------------------
    def ok_or_fail(self, check: str, ex: Exchange) -> bool:
        """Both sides answered 200 with JSON; otherwise record a FAIL with both bodies."""
        bad = [
            f"{side}: HTTP {r.status} {_short(r.body)}"
            for side, r in (("vllm", ex.vllm), ("ours", ex.ours))
            if r.status != 200 or not isinstance(r.body, dict)
        ]
        if bad:
            self.add(check, "FAIL", "request failed", [f"request: {_short(ex.request, 600)}", *bad])
        return not bad

    def show_ids(self, ids: Sequence[int]) -> str:
        return f"{list(ids)} = {self.tokenizer.decode(list(ids))!r}"

    def diff_ids(self, a: Sequence[int], b: Sequence[int]) -> list[str]:
        """Where two id lists part, with the decoded text around the split."""
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo = max(0, i - 8)
        return [
            f"first difference at index {i} (vllm len {len(a)}, ours len {len(b)})",
            f"  vllm[{lo}:{i + 8}] = {self.show_ids(a[lo : i + 8])}",
            f"  ours[{lo}:{i + 8}] = {self.show_ids(b[lo : i + 8])}",
        ]

    # -- (a) response shape -------------------------------------------------------------------
    async def check_shape(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 4,
            "temperature": 0,
            "seed": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        }
        ex = await self.both("shape", body)
        if not self.ok_or_fail("a shape", ex):
            return
        v, o = ex.vllm.body, ex.ours.body
        pairs: list[tuple[str, Any, Any]] = [("response", v, o), ("usage", v.get("usage"), o.get("usage"))]
        vc, oc = _first(v.get("choices")), _first(o.get("choices"))
        pairs += [("choice", vc, oc), ("message", _get(vc, "message"), _get(oc, "message"))]
        vl, ol = _first(_get(_get(vc, "logprobs"), "content")), _first(_get(_get(oc, "logprobs"), "content"))
        pairs += [
            ("logprobs.content[0]", vl, ol),
            ("top_logprobs[0]", _first(_get(vl, "top_logprobs")), _first(_get(ol, "top_logprobs"))),
        ]
        for where, a, b in pairs:
            fails, notes = compare_keys(a, b)
            if fails:
                self.add(
                    f"a shape {where}",
                    "FAIL",
                    "; ".join(fails),
                    [
                        f"request: {_short(body, 400)}",
                        f"vllm {where}: {_short(a, 700)}",
                        f"ours {where}: {_short(b, 700)}",
                    ],
                )
            elif notes:
                self.add(f"a shape {where}", "NOTE", "; ".join(notes))
            else:
                self.add(f"a shape {where}", "PASS", f"{len(a or {})} keys, same types")

    # -- (b) prompt ids -----------------------------------------------------------------------
    async def check_prompt_ids(self) -> dict[str, list[int]]:
        """Same rendered prompt ids for each history; returns vLLM's ids by case name."""
        found: dict[str, list[int]] = {}
        for name, extra in PROMPT_CASES.items():
            body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "seed": 0, "return_token_ids": True, **extra}
            ex = await self.both(f"prompt {name}", body)
            if not self.ok_or_fail(f"b prompt {name}", ex):
                continue
            a, b = ex.vllm.body.get("prompt_token_ids"), ex.ours.body.get("prompt_token_ids")
            if not isinstance(a, list) or not isinstance(b, list):
                self.add(
                    f"b prompt {name}",
                    "FAIL",
                    f"prompt_token_ids missing (vllm {type(a).__name__}, ours {type(b).__name__})",
                )
                continue
            found[name] = a
            if a == b:
                self.add(f"b prompt {name}", "PASS", f"{len(a)} ids identical")
            else:
                self.add(
                    f"b prompt {name}",
                    "FAIL",
                    "prompt ids differ",
                    [f"request: {_short(body, 1500)}", *self.diff_ids(a, b)],
                )
        return found

    # -- (c) token-in -------------------------------------------------------------------------
    async def check_token_in(self, rendered: list[int]) -> None:
        ids = rendered + [1, 2, 3]  # not what the messages render to: proves the ids are used as given
        body = {
            "model": MODEL,
            "messages": PROMPT_CASES["plain"]["messages"],
            "kv_transfer_params": {"prompt_token_ids": ids},
            "max_tokens": 2,
            "temperature": 0,
            "seed": 0,
            "return_token_ids": True,
        }
        ex = await self.both("token-in", body)
        if not self.ok_or_fail("c token-in", ex):
            return
        a, b = ex.vllm.body.get("prompt_token_ids"), ex.ours.body.get("prompt_token_ids")
        problems = [
            f"{side} prompt_token_ids != sent ids: {got}" for side, got in (("vllm", a), ("ours", b)) if got != ids
        ]
        va, ob = _choice_ids(ex.vllm.body), _choice_ids(ex.ours.body)
        if va != ob:
            problems.append(f"greedy continuation differs: vllm {va}, ours {ob}")
        if problems:
            self.add(
                "c token-in", "FAIL", "; ".join(problems)[:200], [f"sent {len(ids)} ids ending {ids[-5:]}", *problems]
            )
        else:
            self.add("c token-in", "PASS", f"both echo the {len(ids)} sent ids (…{ids[-4:]}) and continue with {va}")

    # -- (d) greedy ids and logprobs ----------------------------------------------------------
    async def check_greedy(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
            "max_tokens": 8,
            "temperature": 0,
            "seed": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "return_token_ids": True,
        }
        ex = await self.both("greedy", body)
        if not self.ok_or_fail("d greedy", ex):
            return
        prompt = ex.vllm.body.get("prompt_token_ids") or []
        va, ob = _choice_ids(ex.vllm.body), _choice_ids(ex.ours.body)
        vl, ol = _choice_logprobs(ex.vllm.body), _choice_logprobs(ex.ours.body)
        agree = next((k for k, (x, y) in enumerate(zip(va, ob)) if x != y), min(len(va), len(ob)))
        deltas = [abs(x - y) for x, y in zip(vl[:agree], ol[:agree])]
        worst = max(deltas, default=0.0)
        details = [f"vllm ids {va}", f"ours ids {ob}", f"vllm logprobs {_fmt(vl)}", f"ours logprobs {_fmt(ol)}"]
        if va == ob:
            verdict: Verdict = "PASS" if worst <= self.logprob_tol else "FAIL"
            self.add("d greedy ids", "PASS", f"{len(va)} ids identical: {self.show_ids(va)}")
            self.add(
                "d greedy logprobs",
                verdict,
                f"max |Δ| {worst:.2e} over {len(deltas)} positions (tol {self.logprob_tol:g})",
                details if verdict == "FAIL" else [],
            )
        else:
            # A near-uniform random model has close runners-up, so a tiny numeric difference can
            # flip an argmax; say where, and show both sides' top candidates there.
            tops = []
            for side, reply in (("vllm", ex.vllm.body), ("ours", ex.ours.body)):
                entries = _get(_get(_first(reply.get("choices")), "logprobs"), "content") or []
                if agree < len(entries):
                    tops.append(
                        f"{side} top_logprobs at {agree}: "
                        + ", ".join(
                            f"{t['token']!r} {t['logprob']:.6f}" for t in entries[agree].get("top_logprobs", [])
                        )
                    )
            # fp32 on both sides should give identical ids; bf16 rounding may legitimately flip one.
            flip: Verdict = "FAIL" if self.strict_ids else "NOTE"
            self.add("d greedy ids", flip, f"ids diverge at position {agree}", details + tops)
            self.add(
                "d greedy logprobs",
                "PASS" if worst <= self.logprob_tol else "FAIL",
                f"before the divergence: max |Δ| {worst:.2e} over {len(deltas)} positions",
            )
        # The strings clients see: each entry's token text and bytes, and the top-5 alternatives.
        ve, oe = _entries(ex.vllm.body), _entries(ex.ours.body)
        bad = next((k for k, (x, y) in enumerate(zip(ve, oe)) if x != y), None)
        if bad is None and len(ve) == len(oe):
            self.add(
                "d greedy entries",
                "PASS",
                f"token/bytes and top_logprobs (token, logprob to 1e-4) identical at {len(ve)} positions",
            )
        else:
            at = bad if bad is not None else min(len(ve), len(oe))
            self.add(
                "d greedy entries",
                "FAIL",
                f"logprobs.content differs at position {at}",
                [f"vllm {ve[at : at + 1]}", f"ours {oe[at : at + 1]}"],
            )
        # Teacher forcing: vLLM scores OUR sampled ids as prompt positions (prompt_logprobs), so
        # every position is compared even if the argmax flipped somewhere.
        await self.check_teacher_forced(body["messages"], prompt, ob, ol)

    async def check_teacher_forced(
        self, messages: Any, prompt: list[int], ours_ids: list[int], ours_lps: list[float]
    ) -> None:
        if not prompt or not ours_ids:
            self.add("d teacher-forced", "FAIL", "nothing to teacher-force (no prompt or response ids)")
            return
        body = {
            "model": MODEL,
            "messages": messages,
            "kv_transfer_params": {"prompt_token_ids": prompt + ours_ids},
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
        }
        ex = await self.both("teacher-forced", body)
        reply = ex.vllm
        if ex.ours.status == 200 and isinstance(ex.ours.body, dict) and ex.ours.body.get("prompt_logprobs") is None:
            self.add(
                "d prompt_logprobs ours",
                "NOTE",
                "our engine accepts prompt_logprobs but returns null (vLLM returns the teacher-forced logprobs)",
            )
        plp = reply.body.get("prompt_logprobs") if isinstance(reply.body, dict) else None
        if reply.status != 200 or not isinstance(plp, list):
            self.add(
                "d teacher-forced",
                "FAIL",
                f"vLLM prompt_logprobs unavailable: HTTP {reply.status} {_short(reply.body)}",
            )
            return
        scored = [float(plp[len(prompt) + k][str(t)]["logprob"]) for k, t in enumerate(ours_ids)]
        deltas = [abs(x - y) for x, y in zip(scored, ours_lps)]
        worst = max(deltas)
        verdict: Verdict = "PASS" if worst <= self.logprob_tol else "FAIL"
        self.add(
            "d teacher-forced",
            verdict,
            f"vLLM prompt_logprobs of our {len(ours_ids)} ids: max |Δ| {worst:.2e}",
            [f"vllm {_fmt(scored)}", f"ours {_fmt(ours_lps)}"] if verdict == "FAIL" else [],
        )

    # -- (e) logit_bias -----------------------------------------------------------------------
    async def check_logit_bias(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say nothing."}],
            "max_tokens": 8,
            "temperature": 0,
            "seed": 0,
            "logprobs": True,
            "return_token_ids": True,
            "logit_bias": {str(IM_END_ID): 100},
        }
        ex = await self.both("logit_bias", body)
        if not self.ok_or_fail("e logit_bias", ex):
            return
        facts: dict[str, dict[str, Any]] = {}
        for side, reply in (("vllm", ex.vllm.body), ("ours", ex.ours.body)):
            choice = _first(reply.get("choices")) or {}
            facts[side] = {
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": choice.get("token_ids"),
                "logprobs": _choice_logprobs(reply),
                "content": _get(choice.get("message"), "content"),
                "reasoning": _get(choice.get("message"), "reasoning"),
            }
        problems: list[str] = []
        for side, f in facts.items():
            if f["finish_reason"] != "stop" or not f["token_ids"] or f["token_ids"][-1] != IM_END_ID:
                problems.append(f"{side}: finish_reason {f['finish_reason']!r}, token_ids {f['token_ids']}")
        for key in ("finish_reason", "stop_reason", "token_ids", "content", "reasoning"):
            if facts["vllm"][key] != facts["ours"][key]:
                problems.append(f"{key}: vllm {facts['vllm'][key]!r} vs ours {facts['ours'][key]!r}")
        vlp, olp = facts["vllm"]["logprobs"], facts["ours"]["logprobs"]
        delta = abs(vlp[-1] - olp[-1]) if vlp and olp else float("inf")
        if delta > self.logprob_tol:
            problems.append(f"EOS logprob: vllm {vlp} vs ours {olp}")
        summary = f"EOS logprob vllm {vlp[-1] if vlp else None!r}, ours {olp[-1] if olp else None!r} (processed: bias applied)"
        self.add(
            "e logit_bias",
            "FAIL" if problems else "PASS",
            summary,
            problems + [f"vllm: {facts['vllm']}", f"ours: {facts['ours']}"] if problems else [],
        )

    # -- (f) tool-call parsing ----------------------------------------------------------------
    async def check_tool_parsing(self) -> None:
        """Force vLLM to write a Qwen3.5 XML tool call, then parse the same text with ours.

        vLLM applies a grammar only once reasoning has ended. Thinking off: the prompt already
        holds ``</think>``. Thinking on: a +100 ``logit_bias`` forces the token that ends reasoning
        (``</think>``, or ``<tool_call>``, which vLLM's qwen3 parser treats as an implicit end) and
        the grammar takes over from there; a random model would never end reasoning by itself.
        """
        for variant, thinking, bias, prefix, choice in TOOL_VARIANTS:
            check = f"f tool-call {variant}"
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hi with the shell."}],
                "tools": [BASH_TOOL],
                "chat_template_kwargs": {"enable_thinking": thinking},
                "structured_outputs": {"choice": [choice]},
                "max_tokens": 80,
                "temperature": 0,
                "seed": 0,
                "return_token_ids": True,
            }
            if bias is not None:
                body["logit_bias"] = {str(bias): 100}
            ex = await self.both(f"tool parsing {variant}", body)
            if ex.vllm.status != 200 or not isinstance(ex.vllm.body, dict):
                self.add(
                    check,
                    "FAIL",
                    f"vLLM HTTP {ex.vllm.status}: {_short(ex.vllm.body)}",
                    [f"request: {_short(body, 800)}"],
                )
                continue
            choice_body = _first(ex.vllm.body.get("choices")) or {}
            message = choice_body.get("message") or {}
            ids = choice_body.get("token_ids") or []
            text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] in EOS_IDS else ids)
            calls = message.get("tool_calls") or []
            vllm_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            vllm_view = {
                "content": message.get("content"),
                "reasoning": message.get("reasoning"),
                "tool_calls": vllm_calls,
                "finish_reason": choice_body.get("finish_reason"),
            }
            problems: list[str] = []
            if text != prefix + choice:
                problems.append(f"vLLM did not emit the forced text: {text!r}")
            if [(n, json.loads(a)) for n, a in vllm_calls] != [("bash", {"command": "echo hi"})]:
                problems.append(f"vLLM tool_calls: {calls}")
            if vllm_view["finish_reason"] != "tool_calls":
                problems.append(f"vLLM finish_reason {vllm_view['finish_reason']!r}")
            # Our parser on the very text vLLM produced (our server has no grammar engine).
            parsed = parse_output(text, tools=[BASH_TOOL], thinking=thinking)
            ours_view = {
                "content": parsed.content,
                "reasoning": parsed.reasoning,
                "tool_calls": [(c.name, c.arguments) for c in parsed.tool_calls],
                # what engine.py reports for an EOS stop
                "finish_reason": "tool_calls" if parsed.tool_calls else "stop",
            }
            diffs = [
                f"{k}: vllm {vllm_view[k]!r} vs parse_output {ours_view[k]!r}"
                for k in vllm_view
                if vllm_view[k] != ours_view[k]
            ]
            summary = (
                f"vLLM: {len(ids)} ids (canonical encoding {len(self.tokenizer.encode(prefix + choice))}), "
                f"tool_calls {vllm_view['tool_calls']}, finish {vllm_view['finish_reason']!r}, stop_reason {choice_body.get('stop_reason')!r}"
            )
            if problems or diffs:
                details = [
                    f"request: {_short(body, 900)}",
                    f"decoded vLLM text: {text!r}",
                    f"vllm message: {json.dumps(message)}",
                    *problems,
                    *diffs,
                ]
                self.add(check, "FAIL", "; ".join(problems + diffs)[:160], details)
            else:
                self.add(check, "PASS", summary + "; parse_output agrees")
        if ex.ours.status == 200 and isinstance(ex.ours.body, dict):
            ours_calls = _get(_get(_first(ex.ours.body.get("choices")), "message"), "tool_calls")
            self.add(
                "f structured_outputs ours",
                "NOTE",
                f"our engine accepts and ignores structured_outputs (HTTP 200, tool_calls {ours_calls!r})",
            )
        else:
            self.add(
                "f structured_outputs ours",
                "NOTE",
                f"our engine rejects structured_outputs: HTTP {ex.ours.status} {_short(ex.ours.body, 200)}",
            )

    # -- (g) error shapes ---------------------------------------------------------------------
    async def check_errors(self) -> None:
        for name, body, raw, strict in ERROR_CASES:
            ex = await self.both(f"error {name}", body, raw)
            v, o = ex.vllm, ex.ours
            problems: list[str] = []
            notes: list[str] = []
            if v.status != o.status:
                (problems if strict else notes).append(f"status vllm {v.status} vs ours {o.status}")
            if v.status >= 400 and o.status >= 400:
                fails, top_notes = compare_keys(
                    v.body if isinstance(v.body, dict) else None, o.body if isinstance(o.body, dict) else None
                )
                efails, enotes = compare_keys(_get(v.body, "error"), _get(o.body, "error"))
                problems += fails + [f"error.{p}" for p in efails]
                notes += top_notes + [f"error.{n}" for n in enotes]
                vt, ot = _get(_get(v.body, "error"), "type"), _get(_get(o.body, "error"), "type")
                if vt != ot:
                    notes.append(f"error.type vllm {vt!r} vs ours {ot!r}")
            details = [f"vllm: HTTP {v.status} {_short(v.body, 300)}", f"ours: HTTP {o.status} {_short(o.body, 300)}"]
            if problems:
                self.add(f"g error {name}", "FAIL", "; ".join(problems), details)
            elif notes:
                self.add(f"g error {name}", "NOTE", "; ".join(notes), details)
            else:
                self.add(
                    f"g error {name}", "PASS", f"both HTTP {v.status}, same error keys, types and type name", details
                )

    # -- (h) tokens without text ---------------------------------------------------------------
    async def check_odd_tokens(self) -> None:
        """Tokens a sampler can draw that have no clean text: padded vocab rows and lone bytes.

        The model's embedding has 248,320 rows but the vocabulary ends at 248,076, so any
        sampler may draw ids in between; byte tokens like 0xE7 are half a UTF-8 character.
        """
        for name, token_id in (("padded id 248100", 248100), ("lone byte 0xE7 (id 163)", 163)):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "temperature": 0,
                "logprobs": True,
                "return_token_ids": True,
                "logit_bias": {str(token_id): 100},
            }
            ex = await self.both(f"odd token {name}", body)
            if not self.ok_or_fail(f"h {name}", ex):
                continue
            views = {side: _token_view(r.body) for side, r in (("vllm", ex.vllm), ("ours", ex.ours))}
            diffs = [
                f"{k}: vllm {views['vllm'][k]!r} vs ours {views['ours'][k]!r}"
                for k in views["vllm"]
                if views["vllm"][k] != views["ours"][k]
            ]
            if diffs:
                self.add(f"h {name}", "FAIL", "; ".join(diffs)[:160], [f"request: {_short(body)}", *diffs])
            else:
                self.add(f"h {name}", "PASS", f"same ids, token strings, bytes, text: {views['vllm']}")


# (variant, enable_thinking, logit_bias id forced at +100, forced prefix text, choice) for check (f).
TOOL_VARIANTS: list[tuple[str, bool, int | None, str, str]] = [
    ("thinking off", False, None, "", TOOL_CALL_TEXT),
    ("thinking on, </think> first", True, 248069, "</think>", "\n\n" + TOOL_CALL_TEXT),
    ("thinking on, no </think>", True, 248058, "", TOOL_CALL_TEXT),
]

# (name, JSON body, raw bytes instead of JSON, status must match) for check (g).
ERROR_CASES: list[tuple[str, Any, bytes | None, bool]] = [
    ("malformed JSON", None, b'{"model": "polar-tiny-qwen3", "messages": [{"role": "user", ', True),
    ("missing messages", {"model": MODEL, "max_tokens": 1}, None, True),
    ("empty messages", {"model": MODEL, "messages": [], "max_tokens": 1}, None, True),
    ("body not an object", None, b"[1, 2]", True),
    # Our engine serves one model under any name; vLLM checks it. Reported, not a failure.
    (
        "unknown model",
        {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        None,
        False,
    ),
]


# Message histories for check (b); each is merged into a max_tokens=1 request.
PROMPT_CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "system+user": {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ]
    },
    "tool": {"messages": [{"role": "user", "content": "List the files."}], "tools": [BASH_TOOL]},
    "system+tool": {
        "messages": [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "List the files."}],
        "tools": [BASH_TOOL],
    },
    "tool loop": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should run ls.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ],
        "tools": [BASH_TOOL],
    },
    # vLLM's own replies name it "reasoning"; a gateway replays them as history under that key.
    "tool loop, reasoning key": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "I should run ls.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ],
        "tools": [BASH_TOOL],
    },
    # No reasoning field at all: the template recovers it from "<think>…</think>" in the content.
    "think in content": {
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "<think>\nI should run ls.\n</think>\n\nRunning it."},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        ],
    },
    "two tool calls": {
        "messages": [
            {"role": "user", "content": "Show both files."},
            {
                "role": "assistant",
                "content": "Reading both.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "cat a.py", "timeout": 5}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "cat b.py"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
        ],
        "tools": [BASH_TOOL],
    },
    "think stripping": {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "The user greets me."},
            {"role": "user", "content": "What is 2+2?"},
        ]
    },
    "thinking off": {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "content parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "  Part one. "}, {"type": "text", "text": "Part two.  "}],
            }
        ]
    },
}


def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    return "object"


def compare_keys(vllm: Mapping[str, Any] | None, ours: Mapping[str, Any] | None) -> tuple[list[str], list[str]]:
    """(failures, notes) for one JSON object level, following the policy in the module docstring."""
    if vllm is None or ours is None:
        if vllm is ours:
            return [], []
        return [f"object present only on {'vllm' if ours is None else 'ours'}"], []
    fails: list[str] = []
    notes: list[str] = []
    for key in sorted(set(vllm) - set(ours)):
        (notes if vllm[key] is None else fails).append(f"missing in ours: {key} (vllm {_jtype(vllm[key])})")
    for key in sorted(set(ours) - set(vllm)):
        notes.append(f"only in ours: {key} ({_jtype(ours[key])})")
    for key in sorted(set(vllm) & set(ours)):
        a, b = _jtype(vllm[key]), _jtype(ours[key])
        if a == b or {a, b} == {"int", "float"}:
            continue
        if "null" in (a, b) and key in NULLABLE_OK:
            notes.append(f"{key}: vllm {a}, ours {b}")
        else:
            fails.append(f"{key}: vllm {a}, ours {b}")
    return fails, notes


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None


def _first(items: Any) -> Any:
    return items[0] if isinstance(items, list) and items else None


def _choice_ids(body: Mapping[str, Any]) -> list[int]:
    return list(_get(_first(body.get("choices")), "token_ids") or [])


def _choice_logprobs(body: Mapping[str, Any]) -> list[float]:
    content = _get(_get(_first(body.get("choices")), "logprobs"), "content") or []
    return [float(e["logprob"]) for e in content]


def _entries(body: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    content = _get(_get(_first(body.get("choices")), "logprobs"), "content") or []
    return [
        (
            e.get("token"),
            e.get("bytes"),
            [(t.get("token"), round(float(t["logprob"]), 4)) for t in e.get("top_logprobs") or []],
        )
        for e in content
    ]


def _token_view(body: Mapping[str, Any]) -> dict[str, Any]:
    choice = _first(body.get("choices")) or {}
    content = _get(choice.get("logprobs"), "content") or []
    return {
        "token_ids": choice.get("token_ids"),
        "tokens": [(e.get("token"), e.get("bytes")) for e in content],
        "logprobs": [round(float(e["logprob"]), 4) for e in content],
        "content": _get(choice.get("message"), "content"),
        "reasoning": _get(choice.get("message"), "reasoning"),
        "finish_reason": choice.get("finish_reason"),
    }


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.6f}" for v in values) + "]"


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"


def print_table(rows: Sequence[Row]) -> None:
    width = max(len(r.check) for r in rows)
    print(f"{'check'.ljust(width)}  verdict  summary")
    print(f"{'-' * width}  -------  {'-' * 60}")
    for r in rows:
        print(f"{r.check.ljust(width)}  {r.verdict.ljust(7)}  {r.summary}")
        for line in r.details:
            print(f"{' ' * width}           {line}")
    counts = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "FAIL", "NOTE")}
    print(f"\n{counts['PASS']} pass, {counts['FAIL']} fail, {counts['NOTE']} note")


async def collect(args: argparse.Namespace) -> Comparer:
    """Run every check against both servers; the rows and exchanges are on the returned object."""
    tol = args.logprob_tol if args.logprob_tol is not None else (1e-3 if args.vllm_dtype == "float32" else 5e-2)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        cmp = Comparer(session, args.vllm, args.ours, tol, strict_ids=args.vllm_dtype == "float32")
        await cmp.check_shape()  # also vLLM's warm-up request
        rendered = await cmp.check_prompt_ids()
        if "plain" in rendered:
            await cmp.check_token_in(rendered["plain"])
        else:
            cmp.add("c token-in", "FAIL", "skipped: no rendered ids for the plain case")
        await cmp.check_greedy()
        await cmp.check_logit_bias()
        await cmp.check_tool_parsing()
        await cmp.check_errors()
        await cmp.check_odd_tokens()
    return cmp


def report(cmp: Comparer, json_out: str | None) -> None:
    print_table(cmp.rows)
    if cmp.exchanges:
        first = cmp.exchanges[0]
        total = {side: sum(getattr(e, side).seconds for e in cmp.exchanges) for side in ("vllm", "ours")}
        print(
            f"timing: first request (warm-up) vllm {first.vllm.seconds:.1f}s, ours {first.ours.seconds:.1f}s; "
            f"all {len(cmp.exchanges)} requests vllm {total['vllm']:.1f}s, ours {total['ours']:.1f}s"
        )
    if json_out:
        dump = {
            "rows": [asdict(r) for r in cmp.rows],
            "exchanges": [asdict(e) for e in cmp.exchanges],
        }
        with open(json_out, "w") as fh:
            json.dump(dump, fh, indent=1, ensure_ascii=False)
        print(f"requests and both replies: {json_out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--ours", required=True, help="embedded engine base URL")
    parser.add_argument(
        "--vllm-dtype", default="float32", help="dtype vLLM runs in; sets the default logprob tolerance"
    )
    parser.add_argument(
        "--logprob-tol", type=float, default=None, help="max |Δ logprob| (default 1e-3 fp32, 5e-2 otherwise)"
    )
    parser.add_argument("--json-out", help="write every request and both replies here")
    args = parser.parse_args(argv)
    for url in (args.vllm, args.ours):
        host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        if host != "127.0.0.1":
            parser.error(f"{url}: only 127.0.0.1 is allowed")
    cmp = asyncio.run(collect(args))
    report(cmp, args.json_out)
    return 1 if any(r.verdict == "FAIL" for r in cmp.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
