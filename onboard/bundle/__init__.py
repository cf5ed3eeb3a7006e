"""Stage: a bundle on disk. The adapt pipeline that makes one (make), its trials rendered and verified (render) and
what verification said written (verdict), its files read back (files), kernels it names rendered again where the
store lacks them (kernels), putting it in place without losing anything (target), what produced it (provenance)
and its launchers (launcher).

May import: onboard.source, onboard.twin, onboard.inspect, onboard.adapt, onboard.errors, onboard.outputs, runtime.
The agent is handed to `make.adapt` as an object; this stage never imports it."""
