#!/usr/bin/env bash
# Fuzz the native data plane under AddressSanitizer for SECONDS (default 60): build an ASan copy of the extension
# into a temp dir (the installed one is left alone), preload gcc's libasan, run atheris over every entry point.
# Needs gcc, OpenSSL's headers and atheris (pip install atheris). Exits non-zero on a crash or an ASan report.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python -c "import atheris" 2>/dev/null || { echo "fuzz: atheris is not installed (pip install atheris)" >&2; exit 2; }
asan=$(gcc -print-file-name=libasan.so)
[ -e "$asan" ] || { echo "fuzz: gcc has no libasan ($asan)" >&2; exit 2; }

# The extension as pyproject.toml declares it, plus ASan (CFLAGS and LDFLAGS reach setuptools' compiler).
CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" LDFLAGS="-fsanitize=address" \
  python -c "from setuptools import setup; setup()" -q build_ext --build-lib "$tmp/lib" --build-temp "$tmp/build" \
  >"$tmp/build.log" 2>&1 || true
so=$(find "$tmp/lib" -name '_native*.so' | head -1)
if [ -z "$so" ]; then
  echo "fuzz: the ASan build of the extension failed:" >&2
  tail -20 "$tmp/build.log" >&2
  exit 2
fi
mkdir -p "$tmp/corpus"
# A random seed corpus: with no coverage feedback (see fuzz_dataplane.py) mutations start from these.
python -c "import os, sys
for i in range(64): open(os.path.join(sys.argv[1], f'seed{i}'), 'wb').write(os.urandom(64 + 32 * i))" "$tmp/corpus"
echo "fuzz: $seconds s of atheris over $so under ASan"
log="${TMPDIR:-/tmp}/peerd-fuzz.log"
rc=0
PEERD_ASAN_NATIVE="$so" PYTHONMALLOC=malloc LD_PRELOAD="$asan" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
  python tests/fuzz/fuzz_dataplane.py -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="${TMPDIR:-/tmp}/peerd-fuzz-" "$tmp/corpus" >"$log" 2>&1 || rc=$?
grep -E "^fuzz:|^Done|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)" "$log" | tail -5
if [ "$rc" != 0 ]; then
  echo "fuzz: FAILED (exit $rc); the report (whole log: $log):" >&2
  grep -v -E "^#[0-9]+" "$log" | grep -A 40 -E "ERROR: AddressSanitizer|Traceback|Uncaught|==ERROR" | head -60 >&2
fi
exit "$rc"
