"""``python -m pardist.launch``: see :mod:`pardist.launch._cli`."""

from pardist.launch._cli import main

if __name__ == "__main__":
    main()
