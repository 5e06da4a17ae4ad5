#!/usr/bin/env bash
# A fleet of learners on this machine, started by hand: what `diloco-node demo` automates.
#   examples/localhost_fleet.sh [N]    (N learners, default 3; Ctrl-C stops them all)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-3}
D=.venv/bin/diloco-node
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait; echo "logs in $work"' EXIT
$D init-run --name localhost-fleet --key "$work/creator.pem" --inner-steps 50 --out "$work/run.spec"
$D join --run "$work/run.spec" --listen 127.0.0.1:7100 --steps 600 --fast-membership > "$work/learner-0.log" 2>&1 &
sleep 5
for i in $(seq 1 $((N - 1))); do
  $D join --run "$work/run.spec" --listen 127.0.0.1:$((7100 + i)) --peers 127.0.0.1:7100 --steps 600 \
    --fast-membership > "$work/learner-$i.log" 2>&1 &
done
sleep 10
$D status http://127.0.0.1:7100
wait
tail -n 1 "$work"/learner-*.log
