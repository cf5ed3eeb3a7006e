"""The onboarding agent: what no pattern matches, turned into verified runtime code, or left with a reason.

    onboard agent MODEL --out DIR [--policy rules]      # adapt, then one task per leftover
    onboard agent MODEL --out DIR --replay agent.jsonl  # the same bundle from a recorded session, no policy run

The loop (`onboard.agent.loop`), for each leftover (`tasks`): a policy proposes candidates in order, each a
hypothesis of what the module computes and the code of a replacement (a `runtime.generated.Generated`
subclass); `guard` checks the code before anything runs it; `sandbox` runs `probe` in a limited child process,
which holds the candidate against the live HuggingFace module (forward and backward, several seeds and input
scales, outputs that really vary with the input); a failure goes back to the policy as the next round's
input, within a budget. What passes becomes a `generated` entry of the decision, and the whole twin is then
verified exactly as `onboard adapt` verifies it (a generated module that spoils it is refused like any other
reading). Every proposal and result is recorded in the bundle's agent.jsonl (`record`).

Policies: `rules` (`onboard.agent.rules`: readings rendered from templates/generated/, offline and
deterministic); `llm` (`onboard.agent.llm`: the rules first, then a LangChain agent with tools on any
OpenAI-compatible endpoint); a recorded session (`onboard.agent.record.ReplayPolicy`, `--replay`). A candidate
that passes the probe is also timed against the module (`probe.speed`) and left out when clearly slower.

Stage: after bundle (the loop runs `onboard.bundle.make.adapt` with itself); may import source, twin, inspect, adapt,
bundle. Its sandbox (`sandbox/`) imports, besides the agent's own guard, only source and twin (it builds the
reference twin).
"""
