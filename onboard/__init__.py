"""onboard: bring new Mixture-of-Experts models onto the training runtime.

Pipeline (see DESIGN.md): source -> twin -> capture -> patterns -> ModelSpec -> codegen / verify / plan.
"""

__version__ = "0.1.0"
