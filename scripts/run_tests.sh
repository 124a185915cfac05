#!/usr/bin/env bash
# run_tests.sh BIN... — run Check test binaries, print each suite's result and
# a closing "N passed, N failed" line; exit non-zero if any test failed.
set -u
export CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-1200}
pass=0; fail=0; bad=()
# Temporary files: a suite must remove what it writes under /tmp (kvq_test_*, kvq_e2e_*). Files
# newer than the suite's start are listed after it; under CI (or KVQ_TEST_TMPCHECK=1) the suite then fails.
# Elsewhere only a warning: other runs on a shared machine write such files at the same time (nothing is removed:
# they may be another run's).
mark=$(mktemp /tmp/kvq_runmark.XXXXXX)
trap 'rm -f "$mark"' EXIT
for t in "$@"; do
  echo "== $t"
  touch "$mark"
  out=$("$t" 2>&1); rc=$?
  printf '%s\n' "$out"
  left=$(find /tmp -maxdepth 1 \( -name 'kvq_test_*' -o -name 'kvq_e2e_*' \) -newer "$mark" 2>/dev/null | sort)
  if [ -n "$left" ]; then
    if [ -n "${CI:-}" ] || [ "${KVQ_TEST_TMPCHECK:-}" = 1 ]; then
      echo "FAIL: $t left $(wc -l <<<"$left") temporary file(s) under /tmp:"
      sed 's/^/  /' <<<"$left"
      rc=1; fail=$((fail + 1))
    else
      echo "warning: $(wc -l <<<"$left") temporary file(s) under /tmp newer than $t's start (its own, or another run's):"
      sed 's/^/  /' <<<"$left"
    fi
  fi
  line=$(printf '%s\n' "$out" | grep -E '^[0-9]+%: Checks: ' | tail -n1)
  if [ -n "$line" ]; then
    n=$(sed -E 's/.*Checks: ([0-9]+).*/\1/' <<<"$line")
    f=$(sed -E 's/.*Failures: ([0-9]+).*/\1/' <<<"$line")
    e=$(sed -E 's/.*Errors: ([0-9]+).*/\1/' <<<"$line")
    pass=$((pass + n - f - e)); fail=$((fail + f + e))
  else
    fail=$((fail + 1))
  fi
  [ $rc -ne 0 ] && bad+=("$t")
done
echo
[ ${#bad[@]} -gt 0 ] && echo "failing suites: ${bad[*]}"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ] && [ ${#bad[@]} -eq 0 ]
