"""Test tools TensorHub ships, as trio ships ``trio.testing``: the conformance suite
every data-plane transport passes, emulated multi-host clusters (network namespaces, a
delaying relay), peer processes driven in JSON lines, and the adversaries of the chaos
bench (faulty peers, a rogue outsider, an insider with a key).

The library never imports this package (an import-linter contract checks it); the
benchmarks (``tensorhub bench``) and the tests do."""
