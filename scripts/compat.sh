#!/usr/bin/env bash
# Run reshard's test suite (or write its compat fixtures) under another torch release.
#
#   scripts/compat.sh 2.15.0              # venv with torch 2.15.0 + reshard[test]; the suite; a row in docs/compat.md
#   scripts/compat.sh 2.15.0 --fixtures   # venv with torch 2.15.0 alone; tests/data/compat/torch-2.15.0/
#   scripts/compat.sh 2.15.0 --torch-checkpointing   # + torch-checkpointing 0.1.1; tests/data/torch_checkpointing/torch-2.15.0/
#   scripts/compat.sh 2.15.0 -- -x tests/formats   # arguments after -- go to pytest (no row is written then)
#
# Each release gets a venv of its own under $RESHARD_COMPAT_VENVS (default ~/.cache/reshard-compat),
# made once and reused. torch comes from the package index (a CUDA build of about 4 GB: it imports
# and runs on the CPU); this machine's pip constraint, if any, is lifted for that one install.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${1:?usage: scripts/compat.sh TORCH_VERSION [--fixtures | -- PYTEST_ARGS...]}"
shift
mode=suite
pytest_args=()
if [[ "${1:-}" == "--fixtures" ]]; then
    mode=fixtures
elif [[ "${1:-}" == "--torch-checkpointing" ]]; then
    mode=torch-checkpointing
elif [[ "${1:-}" == "--" ]]; then
    shift
    pytest_args=("$@")
fi

venvs="${RESHARD_COMPAT_VENVS:-$HOME/.cache/reshard-compat}"
venv="$venvs/torch-$version"
pip_in() { PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q --constraint /dev/null "$@"; }

if [[ ! -x "$venv/bin/python" ]]; then
    mkdir -p "$venvs"
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    pip_in "torch==$version"
fi

if [[ "$mode" == fixtures ]]; then
    # only what the fixture script imports: every byte it writes is that torch release's own
    pip_in safetensors numpy zstandard
    exec "$venv/bin/python" scripts/make_compat_fixtures.py
fi
if [[ "$mode" == torch-checkpointing ]]; then
    # torch-checkpointing asks for torch >= 2.11: pinned here, so it never replaces the release under test
    pip_in "torch==$version" safetensors numpy "torch-checkpointing==0.1.1"
    exec "$venv/bin/python" scripts/fixtures/make_torch_checkpointing.py
fi

pip_in -e ".[test]"
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
if [[ "$installed" != "$version"* ]]; then
    echo "compat.sh: installing reshard changed torch to $installed (wanted $version)" >&2
    exit 1
fi

log="$(mktemp)"
start=$(date +%s)
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${pytest_args[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
wall=$(( $(date +%s) - start ))

if [[ ${#pytest_args[@]} -eq 0 ]]; then
    "$venv/bin/python" - "$installed" "$log" "$wall" <<'EOF'
import datetime
import platform
import re
import sys
from pathlib import Path

torch_version, log, wall = sys.argv[1], Path(sys.argv[2]).read_text(), int(sys.argv[3])
summary = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line)][-1]
count = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
row = (f"| {torch_version} | {count.get('passed', 0)} | {count.get('failed', 0) + count.get('error', 0) + count.get('errors', 0)} "
       f"| {count.get('skipped', 0)} | {wall // 60} min {wall % 60} s | Python {platform.python_version()} "
       f"| {datetime.date.today().isoformat()} |")
doc = Path("docs/compat.md")
text = doc.read_text()
begin, end = "<!-- compat-table -->", "<!-- /compat-table -->"
head, rest = text.split(begin)
table, tail = rest.split(end)
rows = [r for r in table.strip().splitlines() if r.startswith("| ") and not r.startswith("| torch ")
        and not r.startswith("|---") and r.split("|")[1].strip() != torch_version]
rows.append(row)
rows.sort(key=lambda r: [int(x) if x.isdigit() else 0 for x in re.split(r"[.+]", r.split("|")[1].strip())[:3]])
header = "| torch | passed | failed | skipped | wall (2 cores) | Python | date |\n|---|---|---|---|---|---|---|"
doc.write_text(f"{head}{begin}\n{header}\n" + "\n".join(rows) + f"\n{end}{tail}")
print(f"docs/compat.md: {row}")
EOF
fi
exit "$status"
