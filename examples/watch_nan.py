"""Leave a NaN watch on in a training loop; on the first bad step it names the node.

``watch_nonfinite`` costs one finiteness flag per step. Here the learning rate
is far too high: after a few steps the weights blow up and ``torch.log`` of a
negative activation makes a NaN. The watch replays that step node by node.
"""

import torch

import fxdebug


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.fc(x)) + 1.0
        h = torch.log(h - 0.5 * self.fc.bias.abs().sum())  # NaN once the bias grows
        return self.head(h)


torch.manual_seed(0)
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
watch = fxdebug.watch_nonfinite(net)
for step in range(1, 101):
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(watch(x), y)
    loss.backward()
    report = watch.check(loss=lambda out: torch.nn.functional.mse_loss(out, y))
    if report is not None:
        print(f"step {step}: non-finite values")
        print(report.table())
        break
    optimizer.step()
else:
    raise SystemExit("no NaN in 100 steps")

# Check against eager: the log's input is finite and its output is not.
with torch.no_grad():
    inside = torch.relu(net.fc(x)) + 1.0 - 0.5 * net.fc.bias.abs().sum()
assert torch.isfinite(inside).all() and not torch.isfinite(torch.log(inside)).all()
assert report.forward.key == "log" and report.forward.created
print(f"ok: step {step}: the NaN was created by {report.forward.key} at {report.forward.location}")
