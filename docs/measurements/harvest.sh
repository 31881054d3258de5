# harvest: copy the small files of every finished run under $OUT into $HARVEST (same layout), so that
# nothing measured is lost with the machine. Sourced by the measurement scripts beside it.
#   finished runs (experiment_done.json): metrics.jsonl (gzipped), config.yaml, config.json, experiment_done.json
#   every experiment.json, every drift/drift.json, and a pre-flight's verdict.txt
harvest() {
  (cd "$OUT" && find . -name experiment_done.json -not -path '*/checkpoints/*' -print0) |
    while IFS= read -r -d '' done_file; do
      d=$(dirname "$done_file")
      mkdir -p "$HARVEST/$d"
      gzip -9nc "$OUT/$d/metrics.jsonl" > "$HARVEST/$d/metrics.jsonl.gz"
      for f in config.yaml config.json experiment_done.json; do
        if [ -f "$OUT/$d/$f" ]; then cp -p "$OUT/$d/$f" "$HARVEST/$d/$f"; fi
      done
    done
  (cd "$OUT" && find . \( -name experiment.json -o -path '*/drift/drift.json' -o -path './preflight/verdict.txt' \) \
      -print0) |
    while IFS= read -r -d '' f; do
      mkdir -p "$HARVEST/$(dirname "$f")"
      cp -p "$OUT/$f" "$HARVEST/$f"
    done
}
