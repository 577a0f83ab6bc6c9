import torch
torch.manual_seed(0)
K, N = 128, 384
w = torch.randn(N, K)
x = torch.randn(48, K)
ref = torch.stack([(x[i:i+1] @ w.T)[0] for i in range(48)])
for M in (1, 3, 4, 12, 48):
    a = x[:M] @ w.T
    b = torch.matmul(x[:M].unsqueeze(1), w.T.unsqueeze(0)).squeeze(1)
    c = torch.bmm(x[:M].unsqueeze(1), w.T.unsqueeze(0).expand(M, K, N)).squeeze(1)
    print(M, "mm", torch.equal(a, ref[:M]), "matmul-bcast", torch.equal(b, ref[:M]), "bmm-expand", torch.equal(c, ref[:M]), "b vs c", torch.equal(b, c))
# row alone vs in batch for bmm-expand with M=1
c1 = torch.bmm(x[:1].unsqueeze(1), w.T.unsqueeze(0).expand(1, K, N)).squeeze(1)
c48 = torch.bmm(x.unsqueeze(1), w.T.unsqueeze(0).expand(48, K, N)).squeeze(1)
print("bmm row0 alone vs in 48:", torch.equal(c1[0], c48[0]), "all rows vs per-row bmm:", all(torch.equal(torch.bmm(x[i:i+1].unsqueeze(1), w.T.unsqueeze(0)).squeeze(1)[0], c48[i]) for i in range(48)))
