#!/usr/bin/env bash
# Fresh clone + fresh venv + fresh radixlm cache: time the README's first command
# (install -> first answer), main's tree ("before") and this branch ("after"), alternating.
set -u
declare -A SRC=([before]=/work/main [after]=/work/wt/lightapi)
declare -A REV=([before]=dd531a8 [after]=HEAD)
for run in 1 2 3; do
  for side in before after; do
    rm -rf /tmp/fresh /tmp/fresh-venv /tmp/fresh-cache
    git clone -q "${SRC[$side]}" /tmp/fresh && git -C /tmp/fresh checkout -q "${REV[$side]}"
    python3 -m venv /tmp/fresh-venv
    cmd=$(awk '/^## Quick start/{q=1} q&&/^```bash/{getline; print; exit}' /tmp/fresh/README.md)
    start=$(date +%s.%N)
    (cd /tmp/fresh && env -i HOME="$HOME" LANG=C.UTF-8 PATH=/tmp/fresh-venv/bin:/usr/local/bin:/usr/bin:/bin \
        RADIXLM_CACHE_DIR=/tmp/fresh-cache bash -c "$cmd" > /tmp/fresh-out-$run-$side.txt 2>&1)
    rc=$?
    end=$(date +%s.%N)
    answer=$(tail -1 /tmp/fresh-out-$run-$side.txt); /tmp/fresh-venv/bin/pip list > /tmp/fresh-pip-$run-$side.txt 2>/dev/null
    npkg=$(/tmp/fresh-venv/bin/pip list 2>/dev/null | tail -n +3 | wc -l)
    printf 'run %d %s: %.1f s rc=%d packages=%d answer=%q\n  cmd: %s\n' "$run" "$side" \
        "$(echo "$end - $start" | bc)" "$rc" "$npkg" "$answer" "$cmd"
  done
done
rm -rf /tmp/fresh /tmp/fresh-venv /tmp/fresh-cache
