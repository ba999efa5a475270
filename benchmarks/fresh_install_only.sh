#!/usr/bin/env bash
# Fresh clone + fresh venv: time the install part of the README's first command
# (everything before `&& radixlm generate`), main's tree and this branch, alternating.
set -u
declare -A SRC=([before]=/work/main [after]=/work/wt/lightapi)
declare -A REV=([before]=dd531a8 [after]=HEAD)
for run in $(seq 1 "${RUNS:-2}"); do
  for side in before after; do
    rm -rf /tmp/fresh /tmp/fresh-venv /tmp/fresh-cache
    git clone -q "${SRC[$side]}" /tmp/fresh && git -C /tmp/fresh checkout -q "${REV[$side]}"
    python3 -m venv /tmp/fresh-venv
    cmd=$(awk '/^## Quick start/{q=1} q&&/^```bash/{getline; print; exit}' /tmp/fresh/README.md)
    install=${cmd%% && radixlm generate*}
    start=$(date +%s.%N)
    (cd /tmp/fresh && env -i HOME="$HOME" LANG=C.UTF-8 PATH=/tmp/fresh-venv/bin:/usr/local/bin:/usr/bin:/bin \
        bash -c "$install" > /tmp/fresh-out-$run-$side.txt 2>&1)
    rc=$?
    end=$(date +%s.%N)
    npkg=$(/tmp/fresh-venv/bin/pip list 2>/dev/null | tail -n +3 | wc -l)
    printf 'run %d %s: install %.1f s rc=%d packages=%d load=%s\n  cmd: %s\n' "$run" "$side" \
        "$(echo "$end - $start" | bc)" "$rc" "$npkg" "$(cut -d' ' -f1 /proc/loadavg)" "$install"
  done
done
rm -rf /tmp/fresh /tmp/fresh-venv /tmp/fresh-cache
