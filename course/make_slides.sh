#!/usr/bin/env bash
# Build a reveal.js slide deck from each chapter notebook (slide metadata is set by the notebook author).
#
#   bash course/make_slides.sh                         # every notebooks/NN-*.ipynb → course/build/slides/
#   bash course/make_slides.sh notebooks/03-*.ipynb    # some of them
#   EXECUTE=1 bash course/make_slides.sh               # run each notebook first, so the deck has fresh outputs
#   OUT=/srv/www/fsdp bash course/make_slides.sh       # somewhere else
#   REVEAL_PREFIX=reveal.js bash course/make_slides.sh # a local reveal.js copy (offline rooms), see slides.md
#
# Notebooks are read, never modified: with EXECUTE=1 nbconvert runs a copy in memory.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-course/build/slides}"
mkdir -p "$OUT"
if [ "$#" -eq 0 ]; then
  set -- notebooks/[0-9][0-9]*-*.ipynb  # 06a: a chapter lettered after 06
fi
args=(--to slides --output-dir "$OUT" --SlidesExporter.reveal_scroll=True --SlidesExporter.reveal_theme=simple)
if [ "${EXECUTE:-0}" = 1 ]; then
  args+=(--execute --ExecutePreprocessor.timeout=300)
fi
if [ -n "${REVEAL_PREFIX:-}" ]; then
  args+=(--SlidesExporter.reveal_url_prefix="$REVEAL_PREFIX")
fi
for nb in "$@"; do
  if [ ! -f "$nb" ]; then
    echo "make_slides: no notebook at $nb" >&2
    exit 2
  fi
  jupyter nbconvert "${args[@]}" "$nb"
done
echo "slides in $OUT: open the .slides.html files in a browser (arrow keys; 's' opens speaker notes)"
