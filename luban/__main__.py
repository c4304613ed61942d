import sys

try:
    from luban.cli import main
except KeyboardInterrupt:  # Ctrl-C before luban.cli installed its recorder (its first lines)
    import os

    # luban.interrupt.MESSAGE and luban.errors.EXIT_INTERRUPTED, not imported: this must not be interrupted again
    os.write(2, b"luban: interrupted\n")
    os._exit(130)

sys.exit(main())
