def test_import():
    import multirail
