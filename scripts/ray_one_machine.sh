#!/usr/bin/env bash
# Runs docs/jobs.md's "Ray on one machine" block as written, from the repository root, and fails
# unless the job ends COMPLETED. Two changes, both for shared machines: a free port instead of
# 8000, and instead of the block's final `ray stop` (which stops every Ray process of this user,
# other people's clusters included) the processes of the Ray session this run started are
# stopped by pid. Usage: scripts/ray_one_machine.sh   (about a minute and a half on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
block=$(python - "$port" <<'PY'
import re, sys
text = open("docs/jobs.md").read()
block = re.search(r"<!-- ray-one-machine[^>]*-->\n```bash\n(.*?)```", text, re.S).group(1)
block = block.replace("localhost:8000", f"localhost:{sys.argv[1]}").replace("--port 8000", f"--port {sys.argv[1]}")
print(block.replace("kill %1; ray stop", "kill %1"))
PY
)
before=$(ls -d /tmp/ray/session_2* 2>/dev/null || true)
stop_session() {
    local session
    session=$(comm -13 <(echo "$before") <(ls -d /tmp/ray/session_2* 2>/dev/null) | tail -1)
    [ -n "$session" ] || return 0
    # every process whose command line names this run's session folder: raylet, GCS, agents, workers
    pids=$(ps -eo pid=,args= | awk -v s="$session" 'index($0, s) && !/awk/ {print $1}')
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
    sleep 3
    pids=$(ps -eo pid=,args= | awk -v s="$session" 'index($0, s) && !/awk/ {print $1}')
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
}
trap stop_session EXIT
out=$(bash -euo pipefail -c "$block" 2>&1 | tee /dev/stderr)
echo "$out" | grep -q "^COMPLETED " || { echo "ray_one_machine: the job did not complete" >&2; exit 1; }
echo "ray_one_machine: OK"
