"""Harnesses for tests, benchmarks, ``kvstrata demo`` and ``kvstrata selftest``.

Real processes and servers on one machine (:mod:`.sidecarproc`,
:mod:`.servers`, :mod:`.localstack`), a locally built model
(:mod:`.tinymodel`), the one poller they all wait with (:mod:`.poll`),
reference data and doubles for copier tests (:mod:`.chunkref`,
:mod:`.kvlayouts`, :mod:`.shmdevice`) and the GPU self-test
(:mod:`.selftest`, :mod:`.gpuipc`, :mod:`.gpuworker`). Installed with the
package so the command line can run them; never imported by the sidecar, the
connector or the operator.
"""
