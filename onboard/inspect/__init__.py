"""Stage: `onboard inspect`. The twin's graphs (capture, graph), the subgraphs matched by what they compute
(patterns/), the full-scale ModelSpec (inspection, spec), its costs (accounting) and its printed summary (summary).

May import: onboard.source, onboard.twin, onboard.errors, runtime, predictors."""
