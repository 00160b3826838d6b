/* exec-as [-C DIR FD] UID GID GROUPS CMD [ARG...]: set the supplementary groups
 * (GROUPS is a comma-separated list of gids, or "-" for none), the real/effective/saved
 * gid and uid, then execute CMD as execvp(3) would (a PATH search when CMD has no '/',
 * a file without a #! line run by /bin/sh).
 *
 * With -C, change into DIR once the credentials are the user's, so the user's own
 * permissions decide whether it may be entered (the order of Go's os/exec, which
 * E2B's envd uses), and report the outcome as one byte on descriptor FD before
 * closing it: 0 when entered, else the errno (then exit 126 without running CMD).
 * envd reads that byte before it answers the request, so a refused cwd is still the
 * request's error; a credential failure closes FD unwritten.
 *
 * envd starts a user's command through this (see spawn.py) because CPython can vfork
 * only when it changes no credentials. It is built without libc (x86_64 Linux raw
 * system calls): under gVisor the exec of a static glibc program costs ~5 ms in page
 * faults and start-up, of util-linux's setpriv through the bundle's loader ~12 ms,
 * of this ~1 ms. Exit status 127 when CMD is not found, 126 when it cannot be run,
 * as shells and setpriv report them. */

#define SYS_write 1
#define SYS_close 3
#define SYS_chdir 80
#define SYS_execve 59
#define SYS_exit 60
#define SYS_setresuid 117
#define SYS_setresgid 119
#define SYS_setgroups 116

#define ENOENT 2
#define ENOEXEC 8
#define EACCES 13
#define ENOTDIR 20
#define ENODEV 19
#define ESTALE 116
#define ETIMEDOUT 110

#define MAX_GROUPS 65536
#define PATH_BUF 4096

static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c)
                     : "rcx", "r11", "memory");
    return r;
}

static unsigned int groups[MAX_GROUPS];
static char path[PATH_BUF];

static unsigned long len(const char *s) {
    unsigned long n = 0;
    while (s[n]) n++;
    return n;
}

static void say(const char *s) { sys3(SYS_write, 2, (long)s, (long)len(s)); }

static void die(const char *what, const char *arg, long err) {
    const char *why = err == ENOENT ? "No such file or directory"
                    : err == EACCES ? "Permission denied"
                    : err == ENOTDIR ? "Not a directory"
                    : err == ENOEXEC ? "Exec format error" : "failed";
    say("exec-as: "); say(what); say(arg); say(": "); say(why); say("\n");
    sys3(SYS_exit, err == ENOENT ? 127 : 126, 0, 0);
    for (;;) {}
}

/* A decimal id that fits 32 bits, ended by '\0' or ','; *s is moved past it. */
static long parse_id(const char **s) {
    unsigned long v = 0;
    const char *p = *s;
    if (*p < '0' || *p > '9') return -1;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (unsigned long)(*p - '0');
        if (v > 0xfffffffeUL) return -1;
        p++;
    }
    *s = p;
    return (long)v;
}

static long one_id(const char *s) {
    long v = parse_id(&s);
    return *s ? -1 : v;
}

/* execve, and for a file the kernel will not run (no #!), /bin/sh FILE ARGS as glibc. */
static long try_exec(const char *file, char **argv, char **envp) {
    long err = sys3(SYS_execve, (long)file, (long)argv, (long)envp);
    if (err == -ENOEXEC) {
        char *name = argv[0];
        argv[-1] = "/bin/sh"; /* argv[-1] is our GROUPS argument: free to reuse */
        argv[0] = (char *)file;
        sys3(SYS_execve, (long)"/bin/sh", (long)(argv - 1), (long)envp);
        argv[0] = name;
    }
    return -err;
}

static const char *env_path(char **envp) {
    for (; *envp; envp++) {
        const char *e = *envp;
        if (e[0] == 'P' && e[1] == 'A' && e[2] == 'T' && e[3] == 'H' && e[4] == '=')
            return e + 5;
    }
    return "/bin:/usr/bin"; /* glibc's default */
}

static void run(char **argv, char **envp) {
    const char *file = argv[0];
    for (const char *c = file; *c; c++)
        if (*c == '/') die("", file, try_exec(file, argv, envp));
    if (!*file) die("", file, ENOENT);
    unsigned long flen = len(file);
    long err = ENOENT;
    int denied = 0;
    const char *p = env_path(envp);
    for (;;) {
        const char *end = p;
        while (*end && *end != ':') end++;
        unsigned long dlen = (unsigned long)(end - p);
        if (dlen + flen + 2 <= PATH_BUF) {
            unsigned long i = 0;
            for (; i < dlen; i++) path[i] = p[i];
            if (dlen) path[i++] = '/'; /* an empty element is the current directory */
            for (unsigned long j = 0; j <= flen; j++) path[i + j] = file[j];
            err = try_exec(path, argv, envp);
            if (err == EACCES) denied = 1;
            else if (err != ENOENT && err != ENOTDIR && err != ESTALE && err != ENODEV
                     && err != ETIMEDOUT) die("", file, err);
        }
        if (!*end) break;
        p = end + 1;
    }
    die("", file, denied ? EACCES : err);
}

void cmain(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    const char *dir = 0;
    long report = -1;
    if (argc >= 4 && argv[1][0] == '-' && argv[1][1] == 'C' && !argv[1][2]) {
        dir = argv[2];
        report = one_id(argv[3]);
        if (report < 0 || !*dir) die("bad -C ", argv[3], 0);
        argv += 3;
        argc -= 3;
    }
    if (argc < 5) {
        say("usage: exec-as [-C DIR FD] UID GID GROUPS|- CMD [ARG...]\n");
        sys3(SYS_exit, 126, 0, 0);
    }
    long uid = one_id(argv[1]), gid = one_id(argv[2]);
    if (uid < 0 || gid < 0) die("bad uid or gid ", argv[1], 0);
    long n = 0;
    const char *g = argv[3];
    if (!(g[0] == '-' && !g[1])) {
        for (;;) {
            long v = parse_id(&g);
            if (v < 0 || n == MAX_GROUPS) die("bad groups ", argv[3], 0);
            groups[n++] = (unsigned int)v;
            if (!*g) break;
            if (*g++ != ',') die("bad groups ", argv[3], 0);
        }
    }
    long r = sys3(SYS_setgroups, n, (long)groups, 0);
    if (r == 0) r = sys3(SYS_setresgid, gid, gid, gid);
    if (r == 0) r = sys3(SYS_setresuid, uid, uid, uid);
    if (r != 0) die("setting credentials", "", -r);
    if (dir) {
        unsigned char err = 0;
        long c = sys3(SYS_chdir, (long)dir, 0, 0);
        if (c < 0) err = c < -255 ? 255 : (unsigned char)-c;
        sys3(SYS_write, report, (long)&err, 1);
        sys3(SYS_close, report, 0, 0);
        if (err) sys3(SYS_exit, 126, 0, 0);
    }
    run(argv + 4, envp);
}

__asm__(".text\n.global _start\n_start:\n"
        "  xor %rbp, %rbp\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call cmain\n  hlt\n");
