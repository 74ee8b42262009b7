#!/bin/bash
# Harbor verifier: reward 1 when greet.sh prints exactly "Hello, world", else 0.
out=$(bash greet.sh 2>/dev/null)
if [ "$out" = "Hello, world" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
