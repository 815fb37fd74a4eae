#!/usr/bin/env bash
# Checks that the GPU tests catch each deliberate bug of tools/mutants.tsv: for every mutant, apply
# it, rebuild BUILD_DIR, run the fast GPU tests (then, if none failed, the five long ones), name
# the tests that failed, and restore the sources. Needs a GPU and a configured build directory
# (tools/build.sh makes build/). Exit status: 0 every mutant caught, 1 one survived, 2 usage.
#
#   tools/mutation_check.sh BUILD_DIR [MUTANT...]    build and test them (no MUTANT: all)
#   tools/mutation_check.sh list                     the mutants, with what each bug is
#   tools/mutation_check.sh apply MUTANT             apply one to the working tree, nothing else
#
# Logs: $GEMVZ_MUTANT_LOGS (default /tmp/gemvz-mutants), one build and one ctest log a mutant.
set -u -o pipefail
cd "$(dirname "$0")/.."
table=tools/mutants.tsv
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
names() { grep -v '^#' "$table" | cut -f1; }

# Replaces the mutant's text, which must occur exactly once in its file (tests/mutants_test.cc
# checks that on every build).
apply() {
  local name file old new what content rest
  IFS=$'\t' read -r name file old new what < <(grep -v '^#' "$table" | awk -F'\t' -v n="$1" '$1 == n')
  if [ -z "${name:-}" ]; then echo "no mutant named '$1' in $table" >&2; return 2; fi
  content=$(cat "$file"; printf x) && content=${content%x}
  rest=${content#*"$old"}
  if [ "$rest" = "$content" ] || [ "${rest#*"$old"}" != "$rest" ]; then
    echo "$name: its text does not occur exactly once in $file" >&2; return 1
  fi
  printf '%s' "${content%%"$old"*}$new$rest" > "$file"
}

case "${1:-}" in
  list) grep -v '^#' "$table" | awk -F'\t' '{printf "%-34s %s (%s)\n", $1, $5, $2}'; exit 0 ;;
  apply) [ $# -eq 2 ] || { usage; exit 2; }; apply "$2"; exit $? ;;
esac
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ] || [ ! -f "$1/CMakeCache.txt" ]; then
  usage
  [ $# -ge 1 ] && [ "$1" != "-h" ] && [ "$1" != "--help" ] && echo "not a configured build directory: $1" >&2
  exit 2
fi
build=$1; shift
mutants=("$@")
[ ${#mutants[@]} -eq 0 ] && mapfile -t mutants < <(names)
logs=${GEMVZ_MUTANT_LOGS:-/tmp/gemvz-mutants}
mkdir -p "$logs"

# Every file a mutant may touch, saved once and put back after each mutant and on any exit (then
# touched: the saved copies are older than the objects built from a mutant).
mapfile -t files < <(grep -v '^#' "$table" | cut -f2 | sort -u)
saved=$(mktemp -d)
for f in "${files[@]}"; do mkdir -p "$saved/$(dirname "$f")" && cp -p "$f" "$saved/$f"; done
restore() { for f in "${files[@]}"; do cp -p "$saved/$f" "$f"; done; touch "${files[@]}"; }
trap 'restore; rm -rf "$saved"' EXIT
trap 'exit 130' INT TERM

fast='^(Gemv\.|PdlTest\.|Shard\.|ApiExample\.|CliTest\.Demo)'
long='UnevenSharesOfK|BroadConfigurationSweep|GroupMajorMatchesBlockMajorBitForBit|DispatcherChoicesOnTheSuite|DispatcherChoicesForM17To32'
failed_tests() {  # the tests a ctest log lists as not passed, skipped and disabled ones aside
  grep -E '^\s+[0-9]+ - ' "$1" | grep -vE '\((Skipped|Disabled)\)' |
    sed -E 's/^\s+[0-9]+ - ([^ ]+).*/\1/' | tr '\n' ' '
}
# The baseline: the unmutated sources must pass, on a GPU (without one every test skips and every
# mutant would seem to survive).
touch "${files[@]}"
cmake --build "$build" -j"$(nproc)" > "$logs/build_baseline.log" 2>&1 ||
  { echo "the unmutated build failed ($logs/build_baseline.log)"; exit 2; }
(cd "$build" && ctest -j8 -R "$fast" -E "$long" --timeout 300 > "$logs/ctest_baseline.txt" 2>&1)
if [ -n "$(failed_tests "$logs/ctest_baseline.txt")" ]; then
  echo "the unmutated sources fail: $(failed_tests "$logs/ctest_baseline.txt")"; exit 2
fi
if ! grep -qE 'Gemv\.EveryMFrom1To64 \.+ +Passed' "$logs/ctest_baseline.txt"; then
  echo "the GPU tests did not run (no GPU?): $logs/ctest_baseline.txt"; exit 2
fi
echo "baseline: $(grep -E 'tests passed' "$logs/ctest_baseline.txt")"
survivors=0
for m in "${mutants[@]}"; do
  restore
  if ! apply "$m"; then echo "$m: not applied"; survivors=1; continue; fi
  if ! cmake --build "$build" -j"$(nproc)" > "$logs/build_$m.log" 2>&1; then
    echo "$m: the build failed (a mutant must compile; $logs/build_$m.log)"; survivors=1; continue
  fi
  t0=$(date +%s)
  (cd "$build" && ctest -j8 -R "$fast" -E "$long" --timeout 300 > "$logs/ctest_$m.txt" 2>&1)
  killers=$(failed_tests "$logs/ctest_$m.txt")
  if [ -z "$killers" ]; then
    (cd "$build" && ctest -j8 -R "$long" --timeout 300 > "$logs/long_$m.txt" 2>&1)
    killers=$(failed_tests "$logs/long_$m.txt")
  fi
  if [ -z "$killers" ]; then
    echo "$m: SURVIVED every test ($(( $(date +%s) - t0 )) s)"; survivors=1
  else
    echo "$m: caught by $killers($(( $(date +%s) - t0 )) s)"
  fi
done
restore
echo "rebuilding the unmutated sources"
cmake --build "$build" -j"$(nproc)" > "$logs/build_restored.log" 2>&1 || echo "the rebuild failed"
exit $survivors
