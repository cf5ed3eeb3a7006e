"""Stage: `onboard report`. Run logs condensed per run (runs), drawn as figures (figures), written as one HTML page
and a terminal summary (page).

May import: onboard.errors, onboard.outputs, runtime. It reads run logs only, never a model."""
