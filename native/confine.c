/*
 * --confine (version 10): the sandbox policy's step (docs/design/policy.md). Exec'd in the command's own
 * process, before the command, it restricts itself and execs PROGRAM; what it applies is irreversible
 * and inherited by every child, and the supervisor that started it stays unconfined.
 *
 *   dsh-supervise --confine [--write PATH]... [--deny-read PATH]... [--cpu-seconds N] [--file-bytes N]
 *                 [--memory-bytes N] [--open-files N] -- PROGRAM [ARGS...]
 *   dsh-supervise --confine --probe      (prints "landlock ABI": 0 where the kernel has none)
 *
 * - Files, by Landlock (ABI 1 and later; the rights the running kernel knows are all handled): every
 *   path may be read and executed, and written (written, made, removed, renamed, truncated) only
 *   beneath a --write PATH. A --deny-read PATH may be neither read nor written: the rights are granted
 *   as an allow-list, and each directory on the way to a denied path gets only the right to be listed,
 *   its other entries the full grant (enumerated here, symlinks skipped: one resolves to its target's
 *   rules). So a link or /proc/self/root/... reaches a denied file without rights, and Landlock's
 *   REFER rule refuses a hard link that would give it more. The cost: a new entry made later directly
 *   in a directory on the way has no rights (listing only), and a hard link made before the command
 *   started is another path to the file (path-based rules cannot see it).
 * - Signals and abstract unix sockets (ABI 6): scoped, so the command cannot signal or connect to what
 *   runs outside its domain (its supervisor, the harness).
 * - no_new_privs first: Landlock needs it without CAP_SYS_ADMIN, and a setuid program must not shed
 *   the rules.
 * - Limits, by setrlimit, soft and hard alike (raising a hard limit needs CAP_SYS_RESOURCE); CPU time's
 *   hard limit a second past the soft one (SIGXCPU, then SIGKILL).
 *
 * A PATH may start with ~/ (this process's HOME: the command's, where it runs). One that does not exist
 * is skipped (nothing to grant or to protect; under ~/ without a HOME, the same). Exit status: PROGRAM's (it
 * is exec'd); 125 for usage errors and for rules that cannot be applied (a message on stderr naming
 * the rule): the command never runs unconfined by mistake.
 */
#include "common.h"
#include "confine.h"
#include <dirent.h>
#include <limits.h>
#include <stdint.h>

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

/* The kernel's ABI (linux/landlock.h), spelt out here: the toolchains' headers lag behind. */
#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE (1ULL << 0)
#define LL_WRITE_FILE (1ULL << 1)
#define LL_READ_FILE (1ULL << 2)
#define LL_READ_DIR (1ULL << 3)
#define LL_REFER (1ULL << 13)    /* ABI 2 */
#define LL_TRUNCATE (1ULL << 14) /* ABI 3 */
#define LL_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL (1ULL << 1)               /* ABI 6 */
/* The rights a rule on a file (not a directory) may carry. */
#define LL_FILE_RIGHTS (LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV)
#define LL_READ_RIGHTS (LL_EXECUTE | LL_READ_FILE | LL_READ_DIR)

struct ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct ll_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

#define MAX_PATHS 64

static char *denied[MAX_PATHS];
static int denied_count;
static int ruleset_fd = -1;
static uint64_t handled;

int landlock_abi(void)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

static uint64_t handled_for(int abi)
{
    uint64_t rights = (1ULL << 13) - 1; /* ABI 1: EXECUTE to MAKE_SYM */
    if (abi >= 2)
        rights |= LL_REFER;
    if (abi >= 3)
        rights |= LL_TRUNCATE;
    if (abi >= 5)
        rights |= LL_IOCTL_DEV;
    return rights;
}

/* PATH == DIR or PATH beneath DIR (both canonical). */
static int is_within(const char *path, const char *dir)
{
    size_t n = strlen(dir);
    if (strcmp(dir, "/") == 0)
        return 1;
    return strncmp(path, dir, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

/* One rule: RIGHTS beneath PATH (a file's rule keeps the file rights only). A symlink gets none. */
static void add_rule(const char *path, uint64_t rights)
{
    int fd = open(path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return;
        die("--confine: cannot open %s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0)
        die("--confine: cannot stat %s: %s", path, strerror(errno));
    if (S_ISLNK(st.st_mode)) {
        close(fd);
        return;
    }
    if (!S_ISDIR(st.st_mode))
        rights &= LL_FILE_RIGHTS;
    rights &= handled;
    if (rights != 0) {
        struct ll_path_beneath_attr beneath = {.allowed_access = rights, .parent_fd = fd};
        if (syscall(SYS_landlock_add_rule, ruleset_fd, LL_RULE_PATH_BENEATH, &beneath, 0) < 0)
            die("--confine: cannot add the rule for %s: %s", path, strerror(errno));
    }
    close(fd);
}

/* RIGHTS beneath PATH, except beneath a denied path: a directory on the way to one gets the right to
 * be listed only, and each of its entries (but the way on) the whole grant, and so on down. */
static void grant(const char *path, uint64_t rights)
{
    int on_the_way = 0;
    for (int i = 0; i < denied_count; i++) {
        if (is_within(path, denied[i]))
            return;
        if (is_within(denied[i], path))
            on_the_way = 1;
    }
    if (!on_the_way) {
        add_rule(path, rights);
        return;
    }
    add_rule(path, rights & LL_READ_DIR);
    DIR *dir = opendir(path);
    if (dir == NULL)
        return; /* nothing enumerated, nothing granted beneath: the safe side */
    struct dirent *entry;
    char child[PATH_MAX];
    while ((entry = readdir(dir)) != NULL) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
            continue;
        int n = snprintf(child, sizeof child, "%s/%s", strcmp(path, "/") == 0 ? "" : path, entry->d_name);
        if (n < 0 || (size_t)n >= sizeof child)
            die("--confine: a path beneath %s is too long", path);
        grant(child, rights);
    }
    closedir(dir);
}

/* PATH made canonical (links resolved; a leading ~/ is this process's HOME); NULL for a path that does
 * not exist, or under ~/ without a HOME. */
static char *canonical(const char *path, const char *opt)
{
    char expanded[PATH_MAX];
    if (path[0] == '~' && (path[1] == '/' || path[1] == '\0')) {
        const char *home = getenv("HOME");
        if (home == NULL || home[0] != '/')
            return NULL;
        int n = snprintf(expanded, sizeof expanded, "%s%s", home, path + 1);
        if (n < 0 || (size_t)n >= sizeof expanded)
            die("--confine: %s %s: too long under HOME", opt, path);
        path = expanded;
    }
    if (path[0] != '/')
        die("--confine: %s wants an absolute path or one under ~/, not '%s'", opt, path);
    char *resolved = realpath(path, NULL);
    if (resolved == NULL && errno != ENOENT && errno != ENOTDIR)
        die("--confine: %s %s: %s", opt, path, strerror(errno));
    return resolved;
}

static rlim_t parse_limit(const char *s, const char *opt)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-')
        die("--confine: %s wants a number, not '%s'", opt, s);
    return (rlim_t)v;
}

static void set_limit(int resource, rlim_t value, const char *opt)
{
    /* CPU time: SIGXCPU at the limit (a signal the model can read), SIGKILL a second later for a
     * command that ignores it; the kernel sends SIGKILL at once where the two are equal. */
    struct rlimit limit = {value, resource == RLIMIT_CPU && value != RLIM_INFINITY ? value + 1 : value};
    if (setrlimit(resource, &limit) < 0)
        die("--confine: %s %llu: %s", opt, (unsigned long long)value, strerror(errno));
}

int run_confine(int argc, char **argv)
{
    char *writable[MAX_PATHS];
    int writable_count = 0, i = 2; /* argv[1] is --confine */
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "--probe") == 0 && argc == 3) {
            printf("landlock %d\n", landlock_abi());
            return 0;
        }
        if (i + 1 >= argc)
            die("--confine: %s wants a value", a);
        const char *v = argv[++i];
        if (strcmp(a, "--write") == 0 || strcmp(a, "--deny-read") == 0) {
            int deny = a[2] == 'd';
            if ((deny ? denied_count : writable_count) == MAX_PATHS)
                die("--confine: at most %d %s paths", MAX_PATHS, a);
            char *path = canonical(v, a);
            if (path != NULL) {
                if (deny)
                    denied[denied_count++] = path;
                else
                    writable[writable_count++] = path;
            }
        } else if (strcmp(a, "--cpu-seconds") == 0) {
            set_limit(RLIMIT_CPU, parse_limit(v, a), a);
        } else if (strcmp(a, "--file-bytes") == 0) {
            set_limit(RLIMIT_FSIZE, parse_limit(v, a), a);
        } else if (strcmp(a, "--memory-bytes") == 0) {
            set_limit(RLIMIT_AS, parse_limit(v, a), a);
        } else if (strcmp(a, "--open-files") == 0) {
            set_limit(RLIMIT_NOFILE, parse_limit(v, a), a);
        } else {
            die("--confine: %s is not one of its options", a);
        }
    }
    if (i >= argc)
        die("usage: dsh-supervise --confine [--write PATH]... [--deny-read PATH]... [--cpu-seconds N] "
            "[--file-bytes N] [--memory-bytes N] [--open-files N] -- PROGRAM [ARGS...]\n"
            "       dsh-supervise --confine --probe");
    int abi = landlock_abi();
    if (abi < 1)
        die("--confine: this kernel has no Landlock (or it is disabled): the file rules cannot be applied");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("--confine: prctl(PR_SET_NO_NEW_PRIVS): %s", strerror(errno));
    handled = handled_for(abi);
    struct ll_ruleset_attr attr = {.handled_access_fs = handled};
    if (abi >= 6)
        attr.scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL;
    ruleset_fd = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    if (ruleset_fd < 0)
        die("--confine: landlock_create_ruleset: %s", strerror(errno));
    grant("/", LL_READ_RIGHTS);
    for (int w = 0; w < writable_count; w++)
        grant(writable[w], handled);
    if (syscall(SYS_landlock_restrict_self, ruleset_fd, 0) < 0)
        die("--confine: landlock_restrict_self: %s", strerror(errno));
    close(ruleset_fd);
    execvp(argv[i], argv + i);
    die("--confine: cannot run %s: %s", argv[i], strerror(errno));
}
