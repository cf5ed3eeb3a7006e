"""Stage: reviewing bundles. `onboard check` (each committed bundle made again and re-verified), `onboard review`
(what changed between two bundles: changes), `onboard verify` (reverify) and the support table of every family
transformers ships (families).

May import every earlier stage: source, twin, inspect, adapt, bundle, agent."""
