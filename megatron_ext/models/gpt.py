"""GPTModel with the recipe's MTP training: self-distillation and an optionally detached trunk.

Megatron-Core's GPTModel trains MTP layers with a hard-label cross-entropy against the shifted labels, computed
inside `_postprocess`. This subclass leaves that path as is for `--mtp-loss ce` and otherwise lets it run for
logging only (its weight is zero) while adding the losses of `megatron_ext.mtp.distill` on the MTP hidden states
that Megatron-Core's MTP block produced. Nothing of Megatron-Core is copied or patched: the MTP block's inputs
are detached through forward hooks, and the main head's logits are observed where GPTModel computes its loss.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from megatron_ext.mtp import distill


class ComposerGPTModel(GPTModel):
    def __init__(self, *args, mtp_loss: str = "ce", mtp_distill_temperature: float = 1.0,
                 mtp_detach_trunk: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if mtp_loss not in ("ce", "self-distill"):
            raise ValueError(f"mtp_loss must be 'ce' or 'self-distill', got {mtp_loss!r}")
        self.mtp_loss, self.mtp_temperature, self.mtp_detach_trunk = mtp_loss, mtp_distill_temperature, mtp_detach_trunk
        # Megatron-Core's MTP cross-entropy is normalised per context-parallel rank (its gradient comes out divided
        # by the CP size), so under CP the hard-label loss runs here too, normalised over the whole sequence.
        self.own_mtp_path = bool(self.config.mtp_num_layers) and (
            mtp_loss != "ce" or mtp_detach_trunk or self.config.context_parallel_size > 1)
        self.mtp_scaling = self.config.mtp_loss_scaling_factor
        if self.own_mtp_path:
            self.config.mtp_loss_scaling_factor = 0.0  # Megatron's MTP cross-entropy: logged, not trained
        self._observed_logits = None
        # RL scores tokens at the sampling temperature by dividing the main head's logits (rl/forward.py) and sets
        # this while it does: the MTP layers' self-distillation teacher stays the policy's own distribution
        self.main_logits_temperature = 1.0

    def compute_language_model_loss(self, labels, logits):
        if self._observed_logits is not None:
            # a copy: Megatron-Core's vocab-parallel cross-entropy overwrites its input with probabilities
            self._observed_logits.append(logits.detach().clone())
        return super().compute_language_model_loss(labels, logits)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if not (self.own_mtp_path and self.mtp_process and labels is not None):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        stash: dict = {}

        def before_mtp(module, margs, mkwargs):
            stash["trunk"] = mkwargs["hidden_states"]
            if self.mtp_detach_trunk:
                embedding = mkwargs["embedding"]
                mkwargs = dict(mkwargs, hidden_states=mkwargs["hidden_states"].detach(),
                               embedding=lambda **kw: embedding(**kw).detach())
            return margs, mkwargs

        def after_mtp(module, margs, mkwargs, output):
            stash["mtp"] = output
            if self.mtp_detach_trunk:  # the main chunk must keep its graph to the trunk
                return torch.cat([stash["trunk"], output[stash["trunk"].size(0):]], dim=0)
            return output

        hooks = [self.mtp.register_forward_pre_hook(before_mtp, with_kwargs=True),
                 self.mtp.register_forward_hook(after_mtp, with_kwargs=True)]
        self._observed_logits = []
        try:
            output = super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            main_logits = self._observed_logits[-1]
            if self.main_logits_temperature != 1.0:
                main_logits = main_logits * self.main_logits_temperature
        finally:
            self._observed_logits = None
            for hook in hooks:
                hook.remove()
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight
        if self.mtp_detach_trunk:
            weight = weight.detach()
        chunks = torch.chunk(stash["mtp"], 1 + self.config.mtp_num_layers, dim=0)[1:]
        mtp_logits = [self.output_layer(h, weight=weight)[0] for h in chunks]
        loss_mask = kwargs.get("loss_mask")
        if loss_mask is None:
            loss_mask = torch.ones_like(labels)
        packed = kwargs.get("packed_seq_params")
        if self.mtp_loss == "self-distill":
            losses = distill.self_distillation_losses(main_logits, mtp_logits, loss_mask, self.mtp_temperature,
                                                      packed)
        else:
            losses = []
            for k, logits in enumerate(mtp_logits, start=1):
                agree = distill.top1_agreement(main_logits, logits, k, packed)
                targets = distill.shift_positions(labels, k, packed)
                ce = self.compute_language_model_loss(targets, logits)
                losses.append((ce, distill.shifted_mask(loss_mask, k, packed), agree))
        return distill.attach(output, losses, self.mtp_scaling, self.config.calculate_per_token_loss, self.training,
                              name="ce loss" if self.mtp_loss == "ce" else "distill loss")
