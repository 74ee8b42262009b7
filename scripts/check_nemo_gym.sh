#!/usr/bin/env bash
# One Polar rollout through NeMo Gym 0.7.0, end to end, against the embedded CPU engine:
#   pyenv's Python 3.13 venv with nemo-gym 0.7.0 (+ polar_env without torch) -> the embedded engine
#   served vLLM-style on 127.0.0.1 (scripted to apply toy__calc-1's fix) -> `ng_run +env=polar_swegym`
#   (Gym finds this repo's environment through NEMO_GYM_EXTRA_ROOTS) -> `gym eval run --no-serve`
#   POSTs the example row to the polar_agent's /run -> a Polar session in the bubblewrap sandbox,
#   graded by swebench -> the row's result is checked: reward 1.0, mask_sample false, and the
#   output items pass NeMo RL's contiguity rule.
#
# nemo-gym 0.5.0-0.7.0 declare Requires-Python >=3.13.14; pyenv here has 3.13.0 and no newer 3.13
# can be fetched offline, so the venv is built with --ignore-requires-python (it imports and runs).
# Gym builds one venv per server with uv and a PyPI nemo-gym, which cannot resolve on 3.13.0 and
# cannot install polar-env (not on PyPI): both server venvs are this one prebuilt venv, reused
# through skip_venv_if_present=true uv_venv_dir=<dir>.
#
# Usage: scripts/check_nemo_gym.sh            (WORK=/tmp/polar_nemo_gym_check, PY313=pyenv's 3.13)
# Needs: pyenv with a 3.13, bubblewrap, network to PyPI for the first venv build (~3 min, 1.5 GB).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-/tmp/polar_nemo_gym_check}"
PY313="${PY313:-$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.13.* 2>/dev/null | sort -V | tail -1)/bin/python3.13}"
POLAR_PY="${POLAR_PY:-python3}"          # the interpreter polar_env (with torch) runs under, for the engine
PORT="${PORT:-18931}"
VENV="$WORK/venv"
GYM_ROOT="$("$POLAR_PY" -m polar_env.integrations.nemo_gym root)"
started=$(date +%s)

[ -x "$PY313" ] || { echo "check_nemo_gym: no Python 3.13 at $PY313 (pyenv install 3.13, or set PY313)" >&2; exit 2; }
command -v bwrap >/dev/null || { echo "check_nemo_gym: bubblewrap is not installed (apt-get install -y bubblewrap)" >&2; exit 2; }
mkdir -p "$WORK"

# 1. the Gym venv: nemo-gym 0.7.0 + uv, then polar_env's core dependencies and its swebench and
#    rollout extras' packages as pyproject.toml lists them (grading in the sandbox runs this venv's
#    python3), then polar_env itself with --no-deps (its embedded extra would bring torch). The
#    requirements install runs every time: an existing venv gets a dependency added since it was built.
if [ ! -f "$VENV/.polar-ready" ]; then
  echo "== building $VENV on $("$PY313" --version)"
  "$PY313" -m venv "$VENV"
  "$VENV/bin/pip" install -q --ignore-requires-python "nemo-gym==0.7.0" uv
  touch "$VENV/.polar-ready"
fi
"$POLAR_PY" -m polar_env.integrations.nemo_gym requirements "$REPO/pyproject.toml" > "$WORK/requirements.txt"
"$VENV/bin/pip" install -q -r "$WORK/requirements.txt"
"$VENV/bin/pip" install -q --no-deps -e "$REPO"
"$VENV/bin/python" -c "import polar_env.integrations.nemo_gym.agent, polar_env.env" \
  || { echo "check_nemo_gym: polar_env does not import in $VENV" >&2; exit 1; }
for server in responses_api_agents/polar_agent environment_servers/legacy_agent; do
  mkdir -p "$WORK/venvs/$server"
  ln -sfn "$VENV" "$WORK/venvs/$server/.venv"
done

pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill -INT -- "-$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 15); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
    kill -TERM -- "-$pid" 2>/dev/null || true
    sleep 2
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  [ -z "${RAY_TMPDIR:-}" ] || rm -rf "$RAY_TMPDIR"
}
trap cleanup EXIT

# 2. the embedded engine, scripted to apply toy__calc-1's gold patch and then answer.
"$POLAR_PY" - "$WORK/script.json" <<'EOF'
import json, sys
from polar_env.tasks.toy import toy_tasks
(task,) = toy_tasks(ids=["toy__calc-1"])
cmd = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{task.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
json.dump({"steps": [{"command": cmd, "reasoning": "Apply the fix."}, {"text": "Done: {tool_output}"}]},
          open(sys.argv[1], "w"))
EOF
setsid "$POLAR_PY" -m polar_env.cli engine --host 127.0.0.1 --port "$PORT" --script "$WORK/script.json" \
  > "$WORK/engine.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do grep -qs " ready " "$WORK/engine.log" && break; sleep 1; done
grep -q " ready " "$WORK/engine.log" || { cat "$WORK/engine.log"; echo "check_nemo_gym: engine did not start" >&2; exit 1; }

# 3. Gym with the spelling users asked for. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Gym's
#    local Ray on 127.0.0.1 (otherwise it binds the machine's address). Ray's own cluster lookup
#    (RAY_ADDRESS, then the address file under its temp dir, /tmp/ray by default) would join any
#    other process's cluster on this machine: no RAY_ADDRESS, and a temp dir of this check's own,
#    so Gym starts a private Ray (a short path: Ray's unix sockets live under it).
unset RAY_ADDRESS
RAY_TMPDIR="$(mktemp -d /tmp/polar_gym_ray.XXXXXX)"
export NEMO_GYM_EXTRA_ROOTS="$GYM_ROOT" PATH="$VENV/bin:$PATH" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_TMPDIR
AGENT=polar_swegym_agent.responses_api_agents.polar_agent
cd "$WORK"
gym env validate --manifest "$GYM_ROOT/environments/polar_swegym/manifest.yaml" > "$WORK/validate.log" 2>&1 \
  || { cat "$WORK/validate.log"; echo "check_nemo_gym: gym env validate failed" >&2; exit 1; }
if grep -q "Warning" "$WORK/validate.log"; then cat "$WORK/validate.log"; exit 1; fi
rm -f out.jsonl
setsid ng_run +env=polar_swegym +policy_base_url="http://127.0.0.1:$PORT/v1" +policy_model_name=polar-tiny-qwen3 \
  +policy_api_key=none +skip_venv_if_present=true +uv_venv_dir="$WORK/venvs" \
  "+$AGENT.polar.harness=loop" "+$AGENT.polar.store=$WORK/capture" > "$WORK/ng_run.log" 2>&1 &
pids+=($!)
for _ in $(seq 180); do grep -qs "polar_swegym_environment_server" "$WORK/ng_run.log" && grep -qs "'url':" "$WORK/ng_run.log" && break; sleep 1; done
sleep 3
grep -q "'url':" "$WORK/ng_run.log" || { tail -50 "$WORK/ng_run.log"; echo "check_nemo_gym: Gym servers did not start" >&2; exit 1; }

# 4. one rollout of the example row (toy__calc-1) through Gym's own collector.
head -1 "$GYM_ROOT/environments/polar_swegym/data/example.jsonl" > "$WORK/one.jsonl"
gym eval run --no-serve --agent polar_swegym_agent --input "$WORK/one.jsonl" --output "$WORK/out.jsonl" \
  --num-repeats 1 > "$WORK/eval.log" 2>&1 || { tail -40 "$WORK/eval.log"; exit 1; }

# 5. the result, checked with polar_env's restatement of NeMo RL's contiguity rule (token ids read
#    only on the item types that carry them: not on reasoning or tool-output items).
"$POLAR_PY" -m polar_env.integrations.nemo_gym check-result "$WORK/out.jsonl"
echo "check_nemo_gym: OK in $(( $(date +%s) - started )) s"
