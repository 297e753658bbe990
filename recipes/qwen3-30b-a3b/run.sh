#!/usr/bin/env bash
# Qwen3-30B-A3B on this node: run.sh train|eval|convert [key=value ...]; DRY_RUN=1 prints the checked
# layout and the exact command instead (recipes/lib/launch.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=recipes/qwen3-30b-a3b/recipe.env
source "$here/recipe.env"
# shellcheck source=recipes/lib/launch.sh
source "$here/../lib/launch.sh"
recipe_main "$@"
