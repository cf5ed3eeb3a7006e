#!/usr/bin/env bash
# Review every bundle under bundles/ that differs from BASE: against its BASE version where it had one, in full
# where it is new. Writes OUT/review.md (GitHub markdown) and OUT/number (the pull request, from $NUMBER).
#   bash .github/review-changed-bundles.sh BASE OUT
set -euo pipefail
base=$1 out=$2
mkdir -p "$out/old"
: > "$out/review.md"
printf '%s\n' "${NUMBER:-}" > "$out/number"
changed=$(git diff --name-only "$base" HEAD -- bundles/ | cut -d/ -f2 | sort -u)
for name in $changed; do
  if [ ! -d "bundles/$name" ]; then
    printf '# bundles/%s was removed\n\n' "$name" >> "$out/review.md"
  elif git cat-file -e "$base:bundles/$name/spec.json" 2>/dev/null; then
    git archive "$base" "bundles/$name" | tar -x -C "$out/old"
    onboard review "$out/old/bundles/$name" "bundles/$name" --format github >> "$out/review.md"
  else
    onboard review "bundles/$name" --format github >> "$out/review.md"
  fi
done
if [ ! -s "$out/review.md" ]; then
  echo "No bundle changed in this pull request: \`onboard check\` found every committed bundle up to date." \
    > "$out/review.md"
fi
