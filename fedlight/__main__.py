"""``python -m fedlight`` is the ``fedlight`` command."""

from fedlight.cli import main

if __name__ == "__main__":
    main()
