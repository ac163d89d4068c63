/* A fault for the cluster tests, loaded into one `keel server` with LD_PRELOAD: once the file
 * named by KEEL_TEST_FAIL_SYNC exists, the next fdatasync or fsync of a store segment (a path
 * ending in ".seg") fails with EIO, as a disk's writeback error reports itself, and the file is
 * removed (one failure per trigger: whichever thread removes it fails its sync). Everything
 * else goes to the C library. Unlike a real writeback error the data still reaches the disk:
 * the tests assert what Keel does on the error, not what the kernel drops. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*sync_fn)(int);

/* Whether this sync of `fd` is the one to fail. */
static int fails(int fd) {
    const char *trigger = getenv("KEEL_TEST_FAIL_SYNC");
    if (trigger == NULL || access(trigger, F_OK) != 0) {
        return 0;
    }
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, path, sizeof path - 1);
    if (length < 4) {
        return 0;
    }
    path[length] = '\0';
    if (strcmp(path + length - 4, ".seg") != 0) {
        return 0;
    }
    return unlink(trigger) == 0;
}

static int call(const char *name, int fd) {
    sync_fn real = (sync_fn)dlsym(RTLD_NEXT, name);
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real(fd);
}

int fdatasync(int fd) {
    if (fails(fd)) {
        errno = EIO;
        return -1;
    }
    return call("fdatasync", fd);
}

int fsync(int fd) {
    if (fails(fd)) {
        errno = EIO;
        return -1;
    }
    return call("fsync", fd);
}
