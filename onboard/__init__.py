"""onboard: bring new Mixture-of-Experts models onto the training runtime.

The packages are the stages of the data flow (ARCHITECTURE.md), each importing only the stages before it:

    source.py  a model reference -> its config and modeling code
    twin/      the tiny twin: the same architecture at small dimensions, random fp32 weights
    inspect/   the twin's graphs -> what the model is made of (ModelSpec), its full-scale costs
    adapt/     the adapt decision, code rendered from templates, verification against HuggingFace
    bundle/    a bundle on disk: made (the adapt pipeline), read back, put in place, its provenance and launchers
    agent/     what no pattern matched, taken on by a policy whose code runs sandboxed
    review/    check, review and re-verify committed bundles; the support table of every family
    plan.py    ranked parallel plans (predictors/)
    train/     `onboard train` and `onboard export`: the bundle's model trained by runtime.train
    report/    `onboard report`: what training runs did, from their run logs

errors.py, outputs.py and contract.py (typed readers of the JSON files a bundle holds) serve every stage.
"""

__version__ = "0.1.0"
