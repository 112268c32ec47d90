#!/usr/bin/env bash
# Fill deploy/wheels/ with every wheel the image needs (peerd's dependencies, its [torch] extra, and its build
# backend), for `docker build --build-arg INSTALL_FROM=wheels` / PEERD_INSTALL_FROM=wheels on machines whose
# containers cannot reach PyPI. Runs on the host with the host's pip; the requirement list comes from
# pyproject.toml, so it follows the project; constraints.txt pins torch (the CPU build, about 190 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mapfile -t reqs < <("$PYTHON" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
for r in d["build-system"]["requires"] + ["wheel"] + d["project"]["dependencies"] \
        + d["project"]["optional-dependencies"]["torch"]:
    print(r)
PY
)
mkdir -p deploy/wheels
"$PYTHON" -m pip download -q --disable-pip-version-check --only-binary=:all: -c constraints.txt -d deploy/wheels \
  "${reqs[@]}" 2>&1 \
  | grep -v "is ignored: it is neither" || true
# pip's exit status is lost in the pipe above: check the result instead.
"$PYTHON" - "${reqs[@]}" <<'PY'
import os, re, sys
have = {re.split(r"-", f)[0].lower().replace("_", "-") for f in os.listdir("deploy/wheels") if f.endswith(".whl")}
missing = [r for r in sys.argv[1:] if re.split(r"[<>=!~ ;\[]", r)[0].lower().replace("_", "-") not in have]
if missing:
    sys.exit(f"fetch-wheels: no wheel in deploy/wheels for {missing}")
PY
echo "deploy/wheels: $(ls deploy/wheels/*.whl | wc -l) wheels, $(du -sh deploy/wheels | cut -f1)"
