# Sourced by the GPU scripts that run a `loraplane up` cluster (e2e.sh, rl_step.sh): `. scripts/gpu/reap.sh`.
# reap_cluster DIR: what a run killed by its timeout left behind, the cluster of data dir DIR (its supervisor restarts
# what dies, so `down` first), then every process still carrying that data dir in LORAPLANE_DATA_DIR (SGLang's server
# and schedulers inherit it from the sampler), which no other process here has.
reap_cluster() {
  local dir=$1 pid
  [ -d "$dir" ] && timeout -k 5 40 python3 -c "from loraplane_cli import app; app()" down --data-dir "$dir" \
    >/dev/null 2>&1
  for pid in $(grep -l -a -x -F "LORAPLANE_DATA_DIR=$dir" --null-data /proc/[0-9]*/environ 2>/dev/null \
               | cut -d/ -f3); do
    [ "$pid" = "$$" ] && continue
    echo "reaping $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-100)"
    kill -9 "$pid" 2>/dev/null
  done
  return 0
}
