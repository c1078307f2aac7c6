/* Loaded into every container process (LD_PRELOAD): a bind to the wildcard address lands on the
 * pod's own loopback address instead, as it would inside a pod's network namespace.
 *
 * The machines have no per-pod network devices (no veth, no dummy), so all pods share the host's
 * network namespace; each owns one address in 127.0.0.0/8 ($LADLE_POD_IP). `ladle serve --host
 * 0.0.0.0 --port 8000` in two pods then binds 127.x.y.1:8000 and 127.x.y.2:8000 side by side.
 * Binds to a specific address, and outgoing connections, are left alone.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int pod_address(struct in_addr *out) {
    const char *text = getenv("LADLE_POD_IP");
    return text != NULL && inet_pton(AF_INET, text, out) == 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    struct in_addr pod;
    if (real_bind == NULL) {
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    }
    if (addr != NULL && pod_address(&pod)) {
        if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
            struct sockaddr_in v4;
            memcpy(&v4, addr, sizeof v4);
            if (v4.sin_addr.s_addr == htonl(INADDR_ANY)) {
                v4.sin_addr = pod;
                return real_bind(fd, (const struct sockaddr *)&v4, sizeof v4);
            }
        } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
            /* "::" becomes the IPv4-mapped pod address (fails on an IPV6_V6ONLY socket). */
            struct sockaddr_in6 v6;
            memcpy(&v6, addr, sizeof v6);
            if (memcmp(&v6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
                memset(&v6.sin6_addr, 0, sizeof v6.sin6_addr);
                v6.sin6_addr.s6_addr[10] = 0xff;
                v6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&v6.sin6_addr.s6_addr[12], &pod, sizeof pod);
                return real_bind(fd, (const struct sockaddr *)&v6, sizeof v6);
            }
        }
    }
    return real_bind(fd, addr, len);
}
