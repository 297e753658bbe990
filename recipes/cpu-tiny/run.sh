#!/usr/bin/env bash
# The CPU demo on this machine through the recipes' launcher: run.sh train|eval [key=value ...];
# DRY_RUN=1 prints the exact command instead (recipes/lib/launch.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=recipes/cpu-tiny/recipe.env
source "$here/recipe.env"
# shellcheck source=recipes/lib/launch.sh
source "$here/../lib/launch.sh"
recipe_main "$@"
