#!/bin/bash
# Harbor verifier writing reward.json: "reward" is what a trainer uses, "exists" a side metric.
want=$(wc -l < data.txt | tr -d ' ')
got=$(tr -d ' \n' < "$EXPECTED_FILE" 2>/dev/null)
exists=0; [ -f "$EXPECTED_FILE" ] && exists=1
reward=0; [ "$got" = "$want" ] && reward=1
printf '{"reward": %s, "exists": %s}\n' "$reward" "$exists" > /logs/verifier/reward.json
