#!/usr/bin/env bash
# run_tests.sh BIN... — run Check test binaries, print each suite's result and
# a closing "N passed, N failed" line; exit non-zero if any test failed.
set -u
export CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-1200}
pass=0; fail=0; bad=()
for t in "$@"; do
  echo "== $t"
  out=$("$t" 2>&1); rc=$?
  printf '%s\n' "$out"
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
