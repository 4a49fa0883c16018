"""pardist.spawn from a plain script: a closure, a collective, rank 0's result."""

import torch

import pardist


def main() -> None:
    scale = 10.0  # captured by the closure below

    def work(n):
        total = pardist.psum(torch.tensor(float(pardist.rank() + 1)), "gpu")
        return [pardist.world_size(), float(total) * scale, n]

    print("result", pardist.spawn(work, 2, 7))


if __name__ == "__main__":
    main()
