"""The training run: the recipe (train.py), its checkpoint policy (ckpt_policy.py), the LR schedule
(schedule.py), torch.compile (compile.py) and its reports (runlog, metrics, TensorBoard, plot)."""
