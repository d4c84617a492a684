#!/usr/bin/env bash
# Before/after on one machine in one run: the offline and serving benchmarks of an
# older commit (BASE) and of this checkout, alternated so that drifting machine load
# falls on both.
#
#   benchmarks/compare_commits.sh BASE [OUT_DIR]
#
# BASE is checked out in a git worktree beside this one with a copy of this
# checkout's .venv (so both run the same torch and libraries), installed editable
# from the worktree. The serving client (benchmarks/serve.py) is this checkout's for
# both; only the server differs. Results: OUT_DIR/{offline,serve}_{before,after}*.json.
set -euo pipefail
base=${1:?usage: compare_commits.sh BASE [OUT_DIR]}
out=${2:-benchmarks/results/compare}
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p "$out"
wt="$top/../tandem-base-$(git rev-parse --short "$base")"
if [ ! -d "$wt" ]; then
  git worktree add -q --detach "$wt" "$base"
  cp -a .venv "$wt/.venv"
  (cd "$wt" && .venv/bin/python -m pip install -q -e . --no-deps)
fi
before_bin="$out/tandem-before"
printf '#!/bin/sh\nexec %s/.venv/bin/python -m tandem.router.cli "$@"\n' "$wt" > "$before_bin"
chmod +x "$before_bin"

offline=(--skip-peer --num-prompts 32 --dtype float32)
for i in 1 2; do
  (cd "$wt" && .venv/bin/python benchmarks/offline_throughput.py "${offline[@]}" \
      --out "$top/$out/offline_before_$i.json")
  .venv/bin/python benchmarks/offline_throughput.py "${offline[@]}" --out "$out/offline_after_$i.json"
done

serve=(--launch disaggregated,colocated --dtype float32 --workload random --num-prompts 16
       --prompt-len 128 512 --output-len 32 64 --request-rate 1 --seed 0
       --slo-ttft 2 --slo-tpot 0.15)
export RAY_AUTH_MODE=disabled
.venv/bin/python benchmarks/serve.py "${serve[@]}" --tandem-bin "$before_bin" --label before \
    --out "$out/serve_before.json"
.venv/bin/python benchmarks/serve.py "${serve[@]}" --label after --out "$out/serve_after.json"
