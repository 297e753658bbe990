#!/usr/bin/env bash
# Qwen2.5-32B with 32k-token responses on this node: run.sh train|eval|convert [key=value ...]; DRY_RUN=1 prints the checked
# layout and the exact command instead (recipes/lib/launch.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=recipes/qwen2.5-32b-32k/recipe.env
source "$here/recipe.env"
# shellcheck source=recipes/lib/launch.sh
source "$here/../lib/launch.sh"
recipe_main "$@"
