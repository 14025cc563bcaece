import test_controller_differential as t

def test_print():
    print("SEEN", sorted(t.SEEN.items()))
