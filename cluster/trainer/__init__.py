"""A trainer: its settings (``config``), its backend's build (``backend``), its follower ranks when it spans several
devices (``ranks``), and the actor itself (``actor``), each importing only those before it; the sampling plane
(``cluster.sampling``) and the GPU groups both share (``cluster.gpu_groups``) import none of them."""
