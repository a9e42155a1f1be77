"""The chaos bench's harness: peer processes with faults (:mod:`.worker`), the mesh of
them (:mod:`.mesh`), one seed's episode (:mod:`.episode`) and its checks
(:mod:`.check`)."""
