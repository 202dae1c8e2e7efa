"""Components are added only where no entry of the same source has them (issue 43 item 3): stock Ubuntu 22.04's
sources.list names multiverse on lines of its own, so nothing is appended to its `main restricted` lines. On the
commit before, multiverse was appended to the jammy, jammy-updates and jammy-security `main restricted` lines."""
from provision.plan.sources import components_present, enable_components

M = "http://mirror.invalid/ubuntu/"
S = "http://security.invalid/ubuntu/"
# the layout of Ubuntu 22.04's stock /etc/apt/sources.list (comments cut), at stand-in mirrors
JAMMY = (f"deb {M} jammy main restricted\n# deb-src {M} jammy main restricted\n"
         f"deb {M} jammy-updates main restricted\n"
         f"deb {M} jammy universe\ndeb {M} jammy-updates universe\n"
         f"deb {M} jammy multiverse\ndeb {M} jammy-updates multiverse\n"
         f"deb {M} jammy-backports main restricted universe multiverse\n"
         f"deb {S} jammy-security main restricted\ndeb {S} jammy-security universe\n"
         f"deb {S} jammy-security multiverse\n")
WANT = ("restricted", "multiverse")


def test_stock_jammy_is_left_as_it_is():
    assert enable_components(JAMMY, WANT, "jammy") == JAMMY


def test_a_suite_without_multiverse_gets_it_once():
    text = f"deb {M} jammy main restricted\ndeb {M} jammy universe\ndeb {M} jammy-updates main\n"
    assert enable_components(text, WANT, "jammy") == (
        f"deb {M} jammy main restricted multiverse\ndeb {M} jammy universe\n"
        f"deb {M} jammy-updates main restricted multiverse\n")


def test_another_file_of_the_host_counts():
    main = f"deb {M} jammy main restricted\n"
    other = f"deb [arch=amd64] {M.rstrip('/')} jammy multiverse\n"  # the same source, written another way
    assert enable_components(main, WANT, "jammy", components_present([main, other])) == main
    assert enable_components(main, WANT, "jammy") == f"deb {M} jammy main restricted multiverse\n"


def test_deb822_stanza_of_the_same_suites():
    text = (f"Types: deb\nURIs: {M}\nSuites: noble noble-updates\nComponents: main restricted universe\n\n"
            f"Types: deb\nURIs: {M}\nSuites: noble noble-updates\nComponents: multiverse\n")
    assert enable_components(text, WANT, "noble") == text
    alone = f"Types: deb\nURIs: {M}\nSuites: noble noble-updates\nComponents: main universe\n"
    assert enable_components(alone, WANT, "noble") == alone.replace("main universe", "main universe restricted "
                                                                                   "multiverse")
