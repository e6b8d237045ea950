"""A trainer over several devices: the frozen base sharded over a group of ranks, the adapters on rank 0.

One trainer is N rank processes joined in one ``torch.distributed`` group (NCCL on CUDA, gloo on the CPU). Every
decoder layer of the base model is ``fully_shard``-ed (FSDP2) over the group, so a rank holds 1/N of those weights
at rest and one layer whole while it runs; the embeddings and the output head stay whole on every rank (the head
is read outside the decoder's forward, and most small models tie it to the embeddings).

Rank 0 is the trainer as before: its ``TorchBackend`` holds every adapter, its optimizer state and its pages, and
answers the engine. The other ranks are followers: a mirror of the LoRA bank, kept current per pass. For each
pass rank 0 sends every follower a plan (``plans``: its share of the coalesced rows, or the same generation) and
broadcasts the weights of the pass's adapters that changed since the followers last saw them; every rank runs its
rows through the sharded base in lockstep (FSDP's all-gathers keep them so), and the followers' LoRA gradients are
summed into rank 0's (``exchange``). Paging, checkpoints and the optimizer run on rank 0 alone, as on one device.
"""
