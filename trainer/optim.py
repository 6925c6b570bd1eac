"""AdamW with a lean step (torch's fused kernel, called once per parameter group) and a lean zero_grad.

At batch 128 on a 2-core CPU a whole MLP training step takes about 0.7 ms. Around its fused kernel,
torch.optim.AdamW's step runs Python (the group's lists rebuilt, tensors grouped by device and dtype, a
dispatch on the options, a profiler label) that costs more in the training loop than when timed alone,
its caches cold after the step's products. Measured on the MLP's step (bench/README.md, "Where the MLP
step's time goes"): this step made it 2.6% faster (epochs alternating in one process), and zero_grad
took 3 us of it instead of 18.
"""
import torch


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) whose step calls torch's fused AdamW kernel directly.

    The same kernel with the same arguments, so parameters and state are bit-identical to
    torch.optim.AdamW(fused=True)'s step after step, and the state_dict is the same: checkpoints move
    between the two both ways. Whatever the direct call does not cover (a first step, which creates the
    state; a closure; a GradScaler's scale; fused=False; capturable, differentiable, complex or sparse
    parameters; a tensor lr or beta; parameters off the CPU or a group mixing dtypes) runs torch's own step.

    Example:
        >>> optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, fused=True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, fused=fused)

    @torch.no_grad()
    def step(self, closure=None):
        calls = None if closure is not None or self._scaled_by_grad_scaler() else self._direct_calls()
        if calls is None:
            return super().step(closure)
        for tensors, group in calls:
            beta1, beta2 = group["betas"]
            self._count_step(group, tensors[0], tensors[-1])
            torch._fused_adamw_(*tensors, amsgrad=group["amsgrad"], lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        return None

    def zero_grad(self, set_to_none=True):
        # torch's, less its profiler label and per-call setup: 18 us of the MLP's step in the training loop
        if not set_to_none:
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None
        return None

    def _count_step(self, group, params, steps):
        """Adds 1 to the step counts, as torch's step does before the kernel: in one add where the group's
        counts are views of one tensor, made so at its first direct step (torch's foreach add loops over
        the counts on the CPU: 8.5 us for six, against 1.7 for one add, and 0.8 when the 1 is a tensor of
        the counts' dtype rather than a Python number, which add_ converts each call). Torch's step, where
        it runs instead, adds 1 to each view in place, so the counts stay right either way."""
        # id(group) -> (the counts' tensor, its views as the group's states hold them, a 1 to add); made
        # here, not in __init__, since an unpickled optimizer gets only torch's attributes back
        if not hasattr(self, "_shared_counts"):
            self._shared_counts = {}
        counts, views, one = self._shared_counts.get(id(group), (None, (), None))
        if len(views) != len(steps) or any(view is not step for view, step in zip(views, steps)):
            if steps[0].dim() != 0 or len({(step.dtype, step.device) for step in steps}) > 1:
                torch._foreach_add_(steps, 1)
                return
            counts = torch.stack(steps)
            steps[:] = [counts[i] for i in range(len(steps))]
            for param, step in zip(params, steps):
                self.state[param]["step"] = step
            one = torch.ones((), dtype=counts.dtype, device=counts.device)
            self._shared_counts[id(group)] = counts, list(steps), one
        counts.add_(one)

    def _scaled_by_grad_scaler(self):
        # GradScaler.step hands a fused optimizer its scale and inf flag through these attributes
        return getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None

    def _direct_calls(self):
        """[(kernel's tensor lists, group)] for this step, or None where torch's step must run."""
        calls = []
        for group in self.param_groups:
            if group["capturable"] or group["differentiable"] or not group["fused"] \
                    or any(isinstance(value, torch.Tensor) for value in (group["lr"], *group["betas"])):
                return None
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if not state or param.grad.is_sparse or param.is_complex():
                    return None
                params.append(param)
                grads.append(param.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            if len({(p.device, p.dtype) for p in params}) > 1 or params[0].device.type != "cpu":
                return None
            calls.append(((params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps), group))
        return calls
