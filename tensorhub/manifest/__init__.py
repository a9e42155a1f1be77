"""What a version is: its tensor specs, how its bytes are cut into chunks and each
chunk's digests (:mod:`.manifest`), with the tensor columns shared between manifests
(:mod:`.table`, :mod:`.columns`) and the digest algorithms (:mod:`.digests`).
Plain data and pure functions: no I/O."""
