"""Stage: a bundle on disk. The adapt pipeline that makes one (make), its files read back (files), kernels it names
rendered again where the store lacks them (kernels), putting it in place without losing anything (placement), what
produced it (provenance) and its launchers (launcher).

May import: onboard.source, onboard.twin, onboard.inspect, onboard.adapt, onboard.errors, onboard.outputs, runtime.
The agent is handed to `make.adapt` as an object; this stage never imports it."""
