#!/usr/bin/env bash
# Step time of mlp_train under mics:2 and zero3 on an emulated cluster whose inter-node links are
# shaped (network namespaces, tc), next to the cost model's prediction: plans.sh with these two
# plans (its options apply).
#   tools/bench/mics_vs_zero3.sh [--nodes 4] [--ranks-per-node 2] [--hidden 2048] [--accum 4]
#                                [--steps 4] [--rate 1gbit]
exec "$(dirname "$0")/plans.sh" --plans "mics:2 zero3" "$@"
