import sys
sys.path.insert(0, "/tmp")
def test_smoke(cluster):
    import smoke2
    smoke2.run(cluster.base_url, "tiny")
