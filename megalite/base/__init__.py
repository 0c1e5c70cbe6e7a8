"""The ground floor: torch-free helpers that every other floor may use and that import nothing above them.

    errors.py   the one user-error family      jsonio.py  bounded JSON and the exact scheduler codec
    faults.py   test hooks (no-ops by default) fs.py      every file-safety rule (the safe opener and writer)
    limits.py   the budget a file from elsewhere is read within: every bound on sizes, depths and numbers
"""
