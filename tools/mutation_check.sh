#!/usr/bin/env bash
# Checks that the tests catch each deliberate bug of tools/mutants.tsv: for every mutant, apply it,
# rebuild BUILD_DIR, run its tests, name those that failed, and restore the sources. A GPU mutant
# runs the GPU tests but the five long ones, then, if none failed, the long ones; it needs a GPU.
# A mutant whose tests field is gpu:REGEX runs the GPU tests REGEX matches, one at a time, which
# must all run, none skip, in the baseline (a 2-GPU test needs a 2-GPU machine). A CPU mutant runs
# the CPU tests its row names, anywhere. First the same tests must pass on the unmutated sources
# (and the GPU tests must really run, not skip). Needs a configured build
# directory (tools/build.sh makes build/). Kernels compile into a JIT cache of the run's own.
# Exit status: 0 every mutant caught; 1 one was not; 2 usage, no GPU, or a failing baseline.
#
#   tools/mutation_check.sh BUILD_DIR [MUTANT...]    build and test them (no MUTANT: all)
#   tools/mutation_check.sh list                     the mutants, what each bug is, their tests
#   tools/mutation_check.sh apply MUTANT             apply one to the working tree, nothing else
#
# Logs: $GEMVZ_MUTANT_LOGS (default /tmp/gemvz-mutants), one build and one ctest log a mutant.
set -u -o pipefail
self=$(readlink -f "$0")
usage() { sed -n '2,16p' "$self" | sed 's/^# \{0,1\}//'; }
build=""
if [ $# -ge 1 ] && [ -d "$1" ]; then build=$(cd "$1" && pwd); fi  # before the cd below
cd "$(dirname "$self")/.."
table=tools/mutants.tsv

# The table's rows (comments and blank lines aside), fields separated by \037 rather than tabs:
# `read` would merge the two tabs around an empty field (a mutant that deletes its text).
rows() { grep -v -e '^#' -e '^$' "$table" | tr '\t' '\037'; }
names() { rows | cut -d $'\037' -f1; }
field() { rows | awk -F'\037' -v n="$1" -v f="$2" '$1 == n { print $f }'; }  # field NAME INDEX

# Replaces the mutant's text, which must occur exactly once in its file (tests/mutants_test.cc
# checks that on every build).
apply() {
  local name="" file old new what tests content rest
  IFS=$'\037' read -r name file old new what tests < <(rows | awk -F'\037' -v n="$1" '$1 == n')
  if [ -z "$name" ]; then echo "no mutant named '$1' in $table" >&2; return 2; fi
  content=$(cat "$file"; printf x) && content=${content%x}
  rest=${content#*"$old"}
  if [ "$rest" = "$content" ] || [ "${rest#*"$old"}" != "$rest" ]; then
    echo "$name: its text does not occur exactly once in $file" >&2; return 1
  fi
  printf '%s' "${content%%"$old"*}$new$rest" > "$file"
}

case "${1:-}" in
  list) rows | awk -F'\037' '{printf "%-34s %s (%s; tests: %s)\n", $1, $5, $2, $6}'; exit 0 ;;
  apply) [ $# -eq 2 ] || { usage; exit 2; }; apply "$2"; exit $? ;;
  -h|--help) usage; exit 0 ;;
  "") usage; exit 2 ;;
esac
if [ -z "$build" ] || [ ! -f "$build/CMakeCache.txt" ]; then
  usage
  echo "not a configured build directory: $1" >&2
  exit 2
fi
shift
mutants=("$@")
[ ${#mutants[@]} -eq 0 ] && mapfile -t mutants < <(names)
for m in "${mutants[@]}"; do  # every name, before minutes of building
  [ -n "$(field "$m" 1)" ] || { echo "no mutant named '$m' in $table (list)" >&2; exit 2; }
done
logs=${GEMVZ_MUTANT_LOGS:-/tmp/gemvz-mutants}
mkdir -p "$logs"

# Every file a mutant may touch, saved once and put back after each mutant and on any exit; only
# a changed file is written back, with a new time, so that the next build recompiles it and no
# more. A second signal during the restore is ignored, so that it cannot stop halfway.
mapfile -t files < <(rows | cut -d $'\037' -f2 | sort -u)
for f in "${files[@]}"; do [ -f "$f" ] || { echo "$table names $f, which does not exist" >&2; exit 2; }; done
saved=$(mktemp -d)
for f in "${files[@]}"; do mkdir -p "$saved/$(dirname "$f")" && cp -p "$f" "$saved/$f"; done
restore() { for f in "${files[@]}"; do cmp -s "$saved/$f" "$f" || cp "$saved/$f" "$f"; done; }
trap 'trap "" INT TERM HUP; restore; rm -rf "$saved"' EXIT
trap 'exit 130' INT TERM HUP
export GEMVZ_CACHE_DIR="$saved/jit-cache"  # mutant kernels stay out of the user's cache

fast='^(Gemv\.|PdlTest\.|Shard\.|ApiExample\.|CliTest\.Demo)'
long='UnevenSharesOfK|BroadConfigurationSweep|GroupMajorMatchesBlockMajorBitForBit|DispatcherChoicesOnTheSuite|DispatcherChoicesForM17To32'
# The tests a ctest log lists as not passed (its lines "  N - Name (State)"), by state.
listed_tests() { grep -E '^\s+[0-9]+ - ' "$1" | sed -E 's/^\s+[0-9]+ - ([^ ]+).*/\1/' | tr '\n' ' '; }
failed_tests() { listed_tests <(grep -vE '\((Skipped|Disabled)\)' "$1"); }  # skipped, disabled aside
skipped_tests() { listed_tests <(grep -E '\(Skipped\)' "$1"); }
# A mutant's tests (a GPU mutant's fast ones). A test that hangs fails at its ctest TIMEOUT
# property (900 s, CMakeLists.txt), which --timeout would not shorten.
run_tests() {  # run_tests gpu|gpu:REGEX|REGEX LOG
  if [ "$1" = gpu ]; then
    (cd "$build" && ctest -j8 -R "$fast" -E "$long" > "$2" 2>&1)
  elif [ "${1#gpu:}" != "$1" ]; then  # one at a time: some time the GPU (the benchmark's)
    (cd "$build" && ctest -j1 -R "${1#gpu:}" > "$2" 2>&1)
  else
    (cd "$build" && ctest -j"$(nproc)" -R "$1" > "$2" 2>&1)
  fi
}

# The baseline: each set of tests the mutants name must pass on the unmutated sources, and the
# GPU tests must run (without a GPU they skip, and every GPU mutant would seem to survive).
cmake --build "$build" -j"$(nproc)" > "$logs/build_baseline.log" 2>&1 ||
  { echo "the unmutated build failed ($logs/build_baseline.log)"; exit 2; }
declare -A baseline_done=()
for m in "${mutants[@]}"; do
  t=$(field "$m" 6)
  [ -n "${baseline_done[$t]:-}" ] && continue
  baseline_done[$t]=1
  log="$logs/ctest_baseline_${#baseline_done[@]}.txt"
  run_tests "$t" "$log"
  if [ -n "$(failed_tests "$log")" ]; then
    echo "the unmutated sources fail: $(failed_tests "$log")($log)"; exit 2
  fi
  if ! grep -qE 'tests passed.* out of [1-9]' "$log"; then
    echo "no test matches the tests of $m ($t): $log"; exit 2
  fi
  if [ "$t" = gpu ] && ! grep -qE 'Gemv\.EveryMFrom1To64 \.+ +Passed' "$log"; then
    echo "the GPU tests did not run (no GPU?): $log. Without a GPU, name CPU mutants (list)"
    exit 2
  fi
  if [ "${t#gpu:}" != "$t" ] && [ -n "$(skipped_tests "$log")" ]; then
    echo "tests of $m skipped here, so it cannot be checked: $(skipped_tests "$log")($log; their" \
      "reasons are in the test output). Name the mutants this machine can check (list)"
    exit 2
  fi
  echo "baseline ($t): $(grep -E 'tests passed' "$log")"
done

survivors=0
for m in "${mutants[@]}"; do
  restore
  if ! apply "$m"; then echo "$m: not applied"; survivors=1; continue; fi
  if ! cmake --build "$build" -j"$(nproc)" > "$logs/build_$m.log" 2>&1; then
    echo "$m: the build failed (a mutant must compile; $logs/build_$m.log)"; survivors=1; continue
  fi
  t0=$(date +%s)
  t=$(field "$m" 6)
  run_tests "$t" "$logs/ctest_$m.txt"
  killers=$(failed_tests "$logs/ctest_$m.txt")
  if [ -z "$killers" ] && [ "$t" = gpu ]; then
    (cd "$build" && ctest -j8 -R "$long" > "$logs/long_$m.txt" 2>&1)
    killers=$(failed_tests "$logs/long_$m.txt")
  fi
  if [ -z "$killers" ]; then
    echo "$m: SURVIVED: no test failed ($(( $(date +%s) - t0 )) s)"; survivors=1
  else
    echo "$m: caught by $killers($(( $(date +%s) - t0 )) s)"
  fi
done
restore
echo "rebuilding the unmutated sources"
cmake --build "$build" -j"$(nproc)" > "$logs/build_restored.log" 2>&1 || echo "the rebuild failed"
exit $survivors
